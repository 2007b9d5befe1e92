"""Where and how `rlfleet run` lays out a run on this machine: its own run directory,
and the threads each torch process may use (tools/run/supervisor.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from rlfleet.common.control.placement import Placed

TORCH_ROLES = ("trainer", "rollout")  # the processes that compute; they share the cores


def torch_threads(placed: list[Placed], host: str) -> int:
    """Threads per torch process so the processes on one machine do not oversubscribe its cores."""
    n = sum(1 for p in placed if p.host == host and p.role in TORCH_ROLES)
    return max(1, (os.cpu_count() or 1) // max(1, n))


def new_run_dir(base: Path) -> Path:
    """base/<YYYYmmdd-HHMMSS>, created here and by no one else: mkdir without exist_ok
    is atomic, so two runs started in the same second get <stamp> and <stamp>-2."""
    base.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        path = base / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{base}: 999 runs started in second {stamp}")
