"""trainer: policy weights, optimizer, journaled experience buffer, checkpoints, weight versions (leader-elected)."""
