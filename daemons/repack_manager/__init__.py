"""repack-manager: rollout stats, long-tail detection, repack plans (leader-elected)."""
