"""rlfleet.relay."""
