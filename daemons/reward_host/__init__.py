"""reward-host: stateless reward workers; scored trajectories go to the trainer until acknowledged."""
