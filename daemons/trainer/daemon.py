"""The trainer daemon: policy weights, optimizer, journaled experience buffer, checkpoints, weight versions (leader-elected).

Foundation stage: registers, heartbeats, elects where it is a singleton role,
serves metrics and shuts down cleanly; the role's data-plane work lands with
the end-to-end issue.
"""

from __future__ import annotations

from rlfleet.common.daemon import Daemon


class Trainer(Daemon):
    role = "trainer"
