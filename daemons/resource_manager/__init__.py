"""resource-manager: node inventory, placement (leader-elected; standbys wait)."""
