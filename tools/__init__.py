"""rlfleet.tools."""
