"""The simulated rollout engine: a timing model, output lengths, and a host process that runs
many simulated rollouts, each its own member."""
