"""rollout: an inference engine with continuous batching; stateless server of generation requests."""
