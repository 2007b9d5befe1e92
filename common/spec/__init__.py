"""The job spec: its sections and fields, reading and checking a spec file, the kinds
that plugins register (seams), placement and filter settings, where a run writes."""
