"""The env-host's journal: what it claimed, and how far each trajectory got.

One JSON object per line, appended (whole lines per write(), so a kill -9 leaves at
most a torn last line, which replay skips; a turn record may wait for the next write
within the same event-loop pass, see runner._journal_turn)::

    {"t": "mark",  "claimed_to": 96}                     highest prompt id claimed + 1
    {"t": "claim", "r": [88, 96]}                        prompt ids [88, 96) are ours
    {"t": "turn",  "id": "p88-g3", "n": 0, "turn": {...}} turn n of a trajectory finished
    {"t": "done",  "id": "p88-g3", "n": 2, "task": ..., "env_reward": ..., "info": {...}, "reason": ""}
    {"t": "ack",   "ids": ["p88-g3"], "ok": true, "error": ""}
    {"t": "spare", "id": "p88-g9", "reason": "redundant"}  kept here, never handed on

A trajectory is handed to the reward-host after its "done" record and forgotten once
acked; a prompt is forgotten when all of its trajectories are acked. ``group_size`` here
is what a prompt launches: the task's group_size plus the spares of redundant rollouts
(docs/guide/agentic.md), which end as "spare" records: never handed on, accounted here with
their reason. Opening
a journal replays it and rewrites it compactly (only live state), and it is compacted
again whenever the file holds many more records than the live state needs.

Replay tells the env-host, per claimed prompt and trajectory: acked (nothing to do),
done (re-send), partial (resume from its turns) or absent (start fresh).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from rlfleet.common.logs import LineWriter
from rlfleet.common.spec.job import JobSpec
from rlfleet.common.spec.run_dir import job_run_dir
from rlfleet.common.wire.arrays import Float32Array, Int32Array
from rlfleet.common.wire.messages import Prompt, Trajectory, Turn
from rlfleet.daemons.tasks.prompts import group_id, parse_trajectory_id, trajectory_id

log = logging.getLogger("rlfleet.env_host")


def journal_path(spec: JobSpec, member_id: str) -> Path:
    """$RLFLEET_RUN_DIR/env-host/<id>.jsonl, else <runs_dir>/<job>/env-host/<id>.jsonl."""
    return job_run_dir(spec) / "env-host" / f"{member_id}.jsonl"


def launched_per_prompt(spec: JobSpec) -> int:
    """Trajectories a prompt launches: its group plus redundant spares (groups.py)."""
    return spec.task.group_size + spec.env_host.redundant_samples


# Compact JSON like json.dumps(separators=(",", ":")), ~5x faster; replay reads it with
# json.loads. Values are finite (checked before they are journaled) and UTF-8 on disk.
_ENCODER = msgspec.json.Encoder()


def turn_to_json(turn: Turn) -> dict[str, Any]:
    # float32 -> Python float -> JSON repr -> float32 round-trips exactly.
    return {"p": turn.prompt_token_ids.tolist(), "t": turn.token_ids.tolist(),
            "l": turn.logprobs.tolist(), "v": turn.weight_version,
            "o": turn.observation, "a": turn.action}


def turn_from_json(d: dict[str, Any]) -> Turn:
    return Turn(Int32Array(d["p"]), Int32Array(d["t"]), Float32Array(d["l"]), int(d["v"]),
                str(d["o"]), str(d["a"]))


@dataclasses.dataclass
class TrajState:
    turns: list[Turn] = dataclasses.field(default_factory=list)
    done: dict[str, Any] | None = None  # the "done" record, once finished
    acked: bool = False
    spare: str = ""  # why it was kept here instead of handed on ("redundant", "env_error", ...)


class TrajectoryJournal:
    """Append-only journal with live state in memory. Thread-safe (one lock)."""

    def __init__(self, path: str | os.PathLike, group_size: int, *, fsync_claims: bool = True,
                 compact_min_records: int = 10_000) -> None:
        self.path = Path(path)
        self.group_size = group_size
        self.fsync_claims = fsync_claims
        self.compact_min_records = compact_min_records
        self.claimed: set[int] = set()  # live prompt ids (not yet fully acked)
        self.trajectories: dict[str, TrajState] = {}
        self.claimed_to = 0
        self.skipped = 0  # unreadable lines met on replay
        self._records = 0  # lines in the file
        self._unwritten: list[bytes] = []  # deferred lines, written with the next write
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self._replay()
        self._fd = -1
        self._compact()

    # -- writing ------------------------------------------------------------------
    def record_claim(self, prompts: range) -> None:
        with self._lock:
            self._append({"t": "claim", "r": [prompts.start, prompts.stop]}, fsync=self.fsync_claims)

    def record_turn(self, tid: str, index: int, turn: Turn, *, defer: bool = False) -> None:
        """``defer``: leave the line for the next write (any record, or flush()) so that
        records made together cost one write(); the caller flushes soon."""
        with self._lock:
            rec = {"t": "turn", "id": tid, "n": index}
            self._append({**rec, "turn": turn_to_json(turn)}, applied={**rec, "turn": turn}, defer=defer)

    def flush(self) -> None:
        """Write the deferred lines."""
        with self._lock:
            if self._unwritten:
                self._write()

    def record_done(self, traj: Trajectory) -> None:
        with self._lock:
            state = self.trajectories.get(traj.trajectory_id)
            journaled = 0 if state is None else len(state.turns)
            if journaled < len(traj.turns):
                # The journal must be able to rebuild exactly what was sent.
                raise ValueError(f"{traj.trajectory_id}: {len(traj.turns)} turns, journal has {journaled}")
            # "n" cuts turns journaled before a replay diverged and the episode restarted.
            self._append({"t": "done", "id": traj.trajectory_id, "n": len(traj.turns),
                          "task": traj.task, "env_reward": traj.env_reward,
                          "info": dict(traj.info), "reason": traj.dropped_reason})

    def record_acked(self, tids: Iterable[str], ok: bool = True, error: str = "") -> None:
        ids = [t for t in tids]
        if not ids:
            return
        with self._lock:
            self._append({"t": "ack", "ids": ids, "ok": ok, "error": error})
            if self._records >= max(self.compact_min_records, 4 * self._live_records()):
                self._compact()

    def record_spare(self, tid: str, reason: str) -> None:
        """A finished or cancelled trajectory the group does not need: done here."""
        with self._lock:
            self._append({"t": "spare", "id": tid, "reason": reason})

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0 and self._unwritten:
                self._write()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    # -- reading ------------------------------------------------------------------
    def status(self, tid: str) -> str:
        """'acked', 'done', 'partial' or 'fresh'."""
        with self._lock:
            s = self.trajectories.get(tid)
            if s is None:
                prompt_id, _ = parse_trajectory_id(tid)
                return "fresh" if prompt_id in self.claimed else "acked"
            return "acked" if s.acked else "done" if s.done is not None else \
                "partial" if s.turns else "fresh"

    def turns(self, tid: str) -> list[Turn]:
        with self._lock:
            s = self.trajectories.get(tid)
            return list(s.turns) if s else []

    def finished(self, tid: str, prompt: Prompt | None = None) -> Trajectory:
        """The trajectory as it was handed to the reward-host (status 'done'). Its
        ``prompt`` is not journaled: the prompt stream rebuilds it from the prompt id."""
        with self._lock:
            s = self.trajectories[tid]
            assert s.done is not None, tid
            prompt_id, _ = parse_trajectory_id(tid)
            return Trajectory(tid, prompt_id, group_id(prompt_id), s.done["task"], list(s.turns),
                              float(s.done["env_reward"]), dict(s.done["info"]), s.done["reason"],
                              prompt=prompt)

    def handed(self, prompt_id: int) -> tuple[int, int]:
        """(handed, good): trajectories of the prompt handed on (or to be re-sent: done or
        acked, not spare), and how many of those finished well (their "done" record has no
        drop reason). The "done" record outlives the ack while the prompt is live."""
        with self._lock:
            states = [s for s in (self.trajectories.get(trajectory_id(prompt_id, k))
                                  for k in range(self.group_size))
                      if s is not None and (s.done is not None or s.acked) and not s.spare]
            return len(states), sum(1 for s in states if s.done is not None and not s.done["reason"])

    def live_prompts(self) -> list[int]:
        with self._lock:
            return sorted(self.claimed)

    # -- internals ----------------------------------------------------------------
    def _append(self, rec: dict[str, Any], fsync: bool = False,
                applied: dict[str, Any] | None = None, defer: bool = False) -> None:
        self._apply(rec if applied is None else applied)
        self._unwritten.append(_ENCODER.encode(rec) + b"\n")
        self._records += 1
        if not defer:
            self._write()
            if fsync:
                os.fsync(self._fd)

    def _write(self) -> None:
        # O_APPEND, whole lines in one write(): a kill -9 tears at most the last line. A
        # short write (a full disk) is cut back off by LineWriter and its lines kept for the
        # next write: a torn line followed by the next append made replay skip both records.
        lines, self._unwritten = self._unwritten, []
        why = LineWriter(self._fd).write(lines[0] if len(lines) == 1 else b"".join(lines))
        if why is not None:
            self._unwritten = lines + self._unwritten
            raise OSError(errno.ENOSPC if why == "no_space" else errno.EIO,
                          f"{self.path}: {len(lines)} journal lines not written ({why}); kept for the next write")

    def _apply(self, rec: dict[str, Any]) -> None:
        kind = rec["t"]
        if kind == "mark":
            self.claimed_to = max(self.claimed_to, int(rec["claimed_to"]))
        elif kind == "claim":
            start, stop = int(rec["r"][0]), int(rec["r"][1])
            self.claimed.update(range(start, stop))
            self.claimed_to = max(self.claimed_to, stop)
        elif kind == "turn":
            tid, n = rec["id"], int(rec["n"])
            state = self.trajectories.setdefault(tid, TrajState())
            # A resumed trajectory whose replay diverged restarts at turn 0: truncate.
            state.turns = state.turns[:n] + [rec["turn"] if isinstance(rec["turn"], Turn)
                                             else turn_from_json(rec["turn"])]
            state.done = None
        elif kind == "done":
            state = self.trajectories.setdefault(rec["id"], TrajState())
            state.turns = state.turns[:int(rec.get("n", len(state.turns)))]
            state.done = {
                "task": str(rec["task"]), "env_reward": float(rec["env_reward"]),
                "info": {str(k): str(v) for k, v in rec["info"].items()}, "reason": str(rec["reason"])}
        elif kind == "ack":
            for tid in rec["ids"]:
                prompt_id = parse_trajectory_id(tid)[0]
                if prompt_id not in self.claimed:
                    continue  # a late duplicate ack for a prompt already forgotten
                self.trajectories.setdefault(tid, TrajState()).acked = True
                self._forget_if_complete(prompt_id)
        elif kind == "spare":
            tid = rec["id"]
            prompt_id = parse_trajectory_id(tid)[0]
            if prompt_id in self.claimed:
                state = self.trajectories.setdefault(tid, TrajState())
                state.acked, state.spare = True, str(rec["reason"]) or "redundant"
                self._forget_if_complete(prompt_id)
        else:
            raise ValueError(f"unknown record type {kind!r}")

    def _forget_if_complete(self, prompt_id: int) -> None:
        tids = [trajectory_id(prompt_id, k) for k in range(self.group_size)]
        if all(t in self.trajectories and self.trajectories[t].acked for t in tids):
            for t in tids:
                del self.trajectories[t]
            self.claimed.discard(prompt_id)

    def _replay(self) -> None:
        with open(self.path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    rec = json.loads(raw)
                    self._apply(rec)
                except Exception as exc:  # noqa: BLE001 — a torn or corrupt line costs only itself
                    self.skipped += 1
                    log.warning("journal %s line %d unreadable, skipped: %s", self.path, lineno, exc)
        log.info("journal %s replayed: %d live prompts, %d trajectories, claimed up to %d",
                 self.path, len(self.claimed), len(self.trajectories), self.claimed_to,
                 extra={"event": "journal_replay"})

    def _live_records(self) -> int:
        return 1 + len(self.claimed) + sum(len(s.turns) + 2 for s in self.trajectories.values())

    def _live(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"t": "mark", "claimed_to": self.claimed_to}]
        for start, stop in _ranges(sorted(self.claimed)):
            out.append({"t": "claim", "r": [start, stop]})
        acked = []
        for tid, s in self.trajectories.items():
            for n, turn in enumerate(s.turns):
                out.append({"t": "turn", "id": tid, "n": n, "turn": turn_to_json(turn)})
            if s.done is not None:
                out.append({"t": "done", "id": tid, "n": len(s.turns), **s.done})
            if s.spare:
                out.append({"t": "spare", "id": tid, "reason": s.spare})
            elif s.acked:
                acked.append(tid)
        if acked:
            out.append({"t": "ack", "ids": acked, "ok": True, "error": ""})
        return out

    def _compact(self) -> None:
        """Rewrite the file as its live state (atomic rename), then append to it."""
        records = self._live()
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        with open(tmp, "wb") as f:
            for rec in records:
                f.write(_ENCODER.encode(rec) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._unwritten = []  # deferred lines: their records are in the live state just written
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._records = len(records)


def _ranges(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted ids -> merged half-open ranges."""
    out: list[tuple[int, int]] = []
    for i in ids:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out
