"""The env-host daemon: EnvManagers (one asyncio task per trajectory), the partial-trajectory journal, prompt claims.

Foundation stage: registers, heartbeats, elects where it is a singleton role,
serves metrics and shuts down cleanly; the role's data-plane work lands with
the end-to-end issue.
"""

from __future__ import annotations

from rlfleet.common.daemon import Daemon


class EnvHost(Daemon):
    role = "env-host"
