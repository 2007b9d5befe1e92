"""The repack-manager daemon: rollout stats, long-tail detection, repack plans (leader-elected).

Foundation stage: registers, heartbeats, elects where it is a singleton role,
serves metrics and shuts down cleanly; the role's data-plane work lands with
the end-to-end issue.
"""

from __future__ import annotations

from rlfleet.common.daemon import Daemon


class RepackManager(Daemon):
    role = "repack-manager"
