"""The relay daemon: CPU copies of the latest weight versions in shared memory; forwards chunks down the relay chain.

Foundation stage: registers, heartbeats, elects where it is a singleton role,
serves metrics and shuts down cleanly; the role's data-plane work lands with
the end-to-end issue.
"""

from __future__ import annotations

from rlfleet.common.daemon import Daemon


class Relay(Daemon):
    role = "relay"
