"""Failpoints for the crash tests: ``RLFLEET_TRAINER_FAILPOINT`` names where the trainer
process dies, so a test can kill it at a point no signal from outside hits reliably.

- ``exit_after_journal`` (intake.py): exit 17 between a trajectory's fsync and its ack;
- ``kill_<where>:<version>``: SIGKILL itself at ``where`` while making ``version``:
  ``mid_step`` (the update is in the weights, the journal has not recorded it),
  ``mid_checkpoint`` (the checkpoint's files are written, its folder not yet renamed),
  ``mid_publish`` (the version is journaled and handed to the publisher thread, whose
  push is under way or waiting).

Unset in production; reading one environment variable is all it costs.
"""

from __future__ import annotations

import os
import signal

FAILPOINT_ENV = "RLFLEET_TRAINER_FAILPOINT"


def kill_at(where: str, version: int) -> None:
    if os.environ.get(FAILPOINT_ENV) == f"kill_{where}:{version}":
        os.kill(os.getpid(), signal.SIGKILL)
