"""The reward-host daemon: stateless reward workers; scored trajectories go to the trainer until acknowledged.

Foundation stage: registers, heartbeats, elects where it is a singleton role,
serves metrics and shuts down cleanly; the role's data-plane work lands with
the end-to-end issue.
"""

from __future__ import annotations

from rlfleet.common.daemon import Daemon


class RewardHost(Daemon):
    role = "reward-host"
