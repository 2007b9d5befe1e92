"""relay: CPU copies of the latest weight versions in shared memory; forwards chunks down the relay chain."""
