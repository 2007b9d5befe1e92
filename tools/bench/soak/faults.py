"""The soak's faults: their schedule, the disk filler, and the summary of what happened.

``fault_schedule`` is pure (every fault with its undo, by time); ``fill`` is the full
disk; ``fault_summary`` reads the fault log the runner kept (how many, how long the
killed daemons and the etcd members took to come back).
"""

from __future__ import annotations

import errno
import os
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ETCD_PHASE_S, DISK_PHASE_S = 20.0, 40.0   # apart from the kills, so the log reads one fault at a time
# The schedule's defaults: the command's options and the results page's method both read them.
KILL_EVERY_MIN = 2.0
ETCD_LOSS_EVERY_MIN, ETCD_DOWN_S = 20.0, 30.0
DISK_FULL_EVERY_MIN, DISK_FULL_S = 60.0, 60.0
QUIET_END_S = 120.0          # no fault this close to the end (at most a tenth of the run)


@dataclass(frozen=True, order=True)
class Fault:
    at_s: float
    kind: str    # kill | etcd_down | etcd_up | disk_fill | disk_free
    n: int = 0   # the n-th fault of its kind (pairs a down with its up)


def fault_schedule(duration_s: float, kill_every_s: float, etcd_every_s: float, etcd_down_s: float,
                   disk_every_s: float, disk_s: float, quiet_end_s: float) -> list[Fault]:
    """Every fault with its undo, sorted by time; one whose undo would fall after
    ``duration_s - quiet_end_s`` is left out. A period <= 0 turns that kind off."""
    end = duration_s - quiet_end_s
    out: list[Fault] = []

    def every(period: float, phase: float, length: float, start: str, stop: str | None) -> None:
        if period <= 0:
            return
        n = 1
        while (t := n * period + phase) + length <= end:
            out.append(Fault(t, start, n))
            if stop:
                out.append(Fault(t + length, stop, n))
            n += 1
    every(kill_every_s, 0.0, 0.0, "kill", None)
    every(etcd_every_s, ETCD_PHASE_S, etcd_down_s, "etcd_down", "etcd_up")
    every(disk_every_s, DISK_PHASE_S, disk_s, "disk_fill", "disk_free")
    return sorted(out)


def fill(folder: Path, path: Path) -> int:
    """Append to ``path`` until the filesystem refuses; bytes written."""
    chunk, written = b"\0" * (1 << 20), 0
    with open(path, "ab", buffering=0) as f:
        while True:
            st = os.statvfs(folder)
            room = st.f_bavail * st.f_frsize
            if room <= 0:
                return written
            try:
                written += f.write(chunk[:min(len(chunk), room)])
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                return written


def fault_summary(faults: list[dict[str, Any]]) -> dict[str, Any]:
    """How many of each, how long the killed daemons and the etcd members took to come back."""
    kills = [f for f in faults if f["kind"] == "kill" and "skipped" not in f]
    back = sorted(f["back_after_s"] for f in kills if f.get("back_after_s") is not None)
    healthy = sorted(f["healthy_after_s"] for f in faults if f.get("healthy_after_s") is not None)
    return {"count": dict(Counter(f["kind"] for f in faults)), "kills_skipped": sum("skipped" in f for f in faults),
            "kills_back": len(back), "kills_not_back": sum(f.get("back_after_s", 0) is None for f in kills),
            "back_after_s_median": statistics.median(back) if back else None,
            "back_after_s_max": back[-1] if back else None,
            "orphaned_children": sum(len(f.get("orphans", [])) for f in kills),
            "etcd_healthy_after_s_max": healthy[-1] if healthy else None}
