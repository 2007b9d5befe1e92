"""The `pipeline` reward backend (DistRS): stages as data, per-stage queues, open batches, the
scaling planner and its thread, the discrete-event simulator, the simulated accelerator."""
