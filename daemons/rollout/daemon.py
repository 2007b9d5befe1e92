"""The rollout daemon: an inference engine with continuous batching; stateless server of generation requests.

Foundation stage: registers, heartbeats, elects where it is a singleton role,
serves metrics and shuts down cleanly; the role's data-plane work lands with
the end-to-end issue.
"""

from __future__ import annotations

from rlfleet.common.daemon import Daemon


class Rollout(Daemon):
    role = "rollout"
