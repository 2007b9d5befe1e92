"""resource-manager: placement from the spec (leader-elected; standbys wait)."""
