"""A job's durable etcd keys as one JSON file, and putting them back (`rlfleet etcd
snapshot` / `restore`, docs/operations/etcd-maintenance.md).

Durable means: not bound to a lease. What a lease holds (member and leader keys, the
owner, node inventories, the master relay, switchover requests) belongs to a process
that is alive now; it re-creates it itself and a copy of it would name a dead process.
The choice is made by each key's lease id, not by a list of names, so a key added
later is kept or skipped by what it is.

The file (format 1):

    {"format": "rlfleet-etcd-snapshot", "version": 1, "job": "demo",
     "revision": 1234, "time": "2025-01-01T00:00:00Z", "endpoints": "h1:2379,...",
     "keys": [{"key": "prompts/cursor", "value": {...}, "mod_revision": 1200}, ...],
     "skipped": [{"key": "members/trainer/trainer-0", "lease": "694d7a1b2c3d4e5f"}, ...]}

`key` is relative to `/rlfleet/<job>/`; `revision` is etcd's revision read just before
the keys, which are read in one range request (one consistent state).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from rlfleet.common.control import keys as names
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.records import Checkpoint, PromptCursor, WeightsLatest
from rlfleet.common.control.store import Store

FORMAT, VERSION = "rlfleet-etcd-snapshot", 1

# Counters that only move forward while the job runs: restoring an older value over a
# newer one would repeat work (prompts claimed twice, a rollout told an older version,
# steps trained again), so restore refuses it unless forced.
_NEVER_BACKWARDS = {
    names.PROMPTS_CURSOR: ("next", lambda v: PromptCursor.parse(v).next,
                           "prompts {old}..{new} would be claimed twice"),
    names.WEIGHTS_LATEST: ("version", lambda v: WeightsLatest.parse(v).version,
                           "rollouts would be sent back to version {old} after {new}, and the trainer's "
                           "next publish would be compared with the older version"),
    names.TRAINER_CHECKPOINT: ("version", lambda v: Checkpoint.parse(v).version,
                               "a trainer that restarts would resume from checkpoint {old} and train "
                               "again what came after it, up to {new}"),
}
# Written first when the keys do not fit one transaction: what paces the fleet.
_FIRST = (names.PROMPTS_CURSOR, names.TRAINER_PROGRESS, names.WEIGHTS_LATEST, names.TRAINER_CHECKPOINT)
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops

_REL_KEY = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")


class SnapshotError(ValueError):
    """The file is not a snapshot this version can restore (the message says where)."""


@dataclass(frozen=True)
class Snapshot:
    job: str
    revision: int
    time: str
    keys: dict[str, Any]                       # relative key -> value
    mod_revisions: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)  # relative key -> its lease id
    endpoints: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "job": self.job, "revision": self.revision,
                "time": self.time, "endpoints": self.endpoints,
                "keys": [{"key": k, "value": v, "mod_revision": self.mod_revisions.get(k, 0)}
                         for k, v in sorted(self.keys.items())],
                "skipped": [{"key": k, "lease": f"{lease:x}"} for k, lease in sorted(self.skipped.items())]}


def take(store: Store, job: str, endpoints: str = "") -> Snapshot:
    """The job's durable keys as they are now."""
    keys = JobKeys(job)
    revision = store.revision()
    durable, mods, skipped = {}, {}, {}
    for kv in store.get_prefix(keys.prefix):
        rel = kv.key.removeprefix(keys.prefix)
        if kv.lease_id:
            skipped[rel] = kv.lease_id
        else:
            durable[rel], mods[rel] = kv.value, kv.mod_revision
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return Snapshot(job, revision, stamp, durable, mods, skipped, endpoints)


def write(snapshot: Snapshot, path: str) -> None:
    """Atomically (a temporary file in the same folder, fsynced, renamed), mode 0600: the
    spec may name paths and hosts an operator would not publish."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".rlfleet-snapshot-", dir=folder)  # mkstemp: 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(snapshot.to_json(), f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)


def load(path: str) -> Snapshot:
    """The snapshot in `path`; SnapshotError naming the first thing wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise SnapshotError(f"{path}: not JSON: {exc}") from None

    def bad(where: str, what: str) -> SnapshotError:
        return SnapshotError(f"{path}: {where}: {what}")

    if not isinstance(data, dict):
        raise bad("top level", f"expected an object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise bad("format", f"expected {FORMAT!r}, got {data.get('format')!r}")
    if data.get("version") != VERSION:
        raise bad("version", f"this rlfleet reads version {VERSION}, got {data.get('version')!r}")
    job = data.get("job")
    try:
        JobKeys(job if isinstance(job, str) else "")
    except ValueError:
        raise bad("job", f"expected a job name, got {job!r}") from None
    revision = data.get("revision")
    if type(revision) is not int or revision < 0:
        raise bad("revision", f"expected an integer >= 0, got {revision!r}")
    entries = data.get("keys")
    if not isinstance(entries, list):
        raise bad("keys", f"expected a list, got {type(entries).__name__}")
    values, mods = {}, {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "value" not in entry:
            raise bad(f"keys[{i}]", "expected an object with 'key' and 'value'")
        rel = entry.get("key")
        if not isinstance(rel, str) or not _REL_KEY.match(rel) or ".." in rel.split("/"):
            raise bad(f"keys[{i}].key", f"expected a key relative to {JobKeys(job).prefix}, got {rel!r}")
        if rel in values:
            raise bad(f"keys[{i}].key", f"{rel!r} appears twice")
        values[rel], mods[rel] = entry["value"], entry.get("mod_revision", 0)
    skipped = {}
    for i, entry in enumerate(data.get("skipped", [])):
        try:
            skipped[str(entry["key"])] = int(entry["lease"], 16)
        except (TypeError, KeyError, ValueError):
            raise bad(f"skipped[{i}]", "expected an object with 'key' and 'lease' (hex)") from None
    return Snapshot(job, revision, str(data.get("time", "")), values, mods, skipped,
                    str(data.get("endpoints", "")))


@dataclass
class RestorePlan:
    """What `restore` would write, and why it would not (`refusals`)."""

    job: str
    values: dict[str, Any]                     # relative key -> value to write
    expected: dict[str, int]                   # relative key -> its mod revision in etcd now (0: absent)
    live: list[str]                            # lease-bound keys now under the job
    refusals: list[str]
    unchanged: list[str]
    extra: list[str]                           # durable keys in etcd that the file lacks (left alone)
    clamped: list[str]                         # fencing terms from a later etcd revision, set to 0
    revision: int = 0

    def batches(self) -> list[list[str]]:
        first = [k for k in _FIRST if k in self.values]
        rest = [k for k in sorted(self.values) if k not in first]
        order = first + rest
        return [order[i:i + MAX_TXN_OPS] for i in range(0, len(order), MAX_TXN_OPS)]


def plan(store: Store, snapshot: Snapshot, force: bool = False) -> RestorePlan:
    keys = JobKeys(snapshot.job)
    revision = store.revision()
    now = {kv.key.removeprefix(keys.prefix): kv for kv in store.get_prefix(keys.prefix)}
    live = sorted(rel for rel, kv in now.items() if kv.lease_id)
    durable_now = {rel: kv for rel, kv in now.items() if not kv.lease_id}
    refusals = []
    if live and not force:
        refusals.append(f"the job is live: {len(live)} lease-bound keys under {keys.prefix} "
                        f"({', '.join(live[:4])}{', ...' if len(live) > 4 else ''}); stop its daemons "
                        "first (restoring under running daemons rewinds what they are writing)")
    values, expected, unchanged, clamped = {}, {}, [], []
    for rel, value in snapshot.keys.items():
        value, note = _clamp_terms(rel, value, revision)
        if note:
            clamped.append(note)
        current = now.get(rel)
        if current is not None and current.value == value:
            unchanged.append(rel)
            continue
        guard = _NEVER_BACKWARDS.get(rel)
        if guard is not None and current is not None and not force:
            name, read, why = guard
            old, new = read(value), read(current.value)
            if old < new:
                refusals.append(f"{rel}: the file's {name} {old} is older than etcd's {new}: "
                                f"{why.format(old=old, new=new)} (--force writes it anyway)")
        values[rel] = value
        expected[rel] = current.mod_revision if current is not None else 0
    extra = sorted(set(durable_now) - set(snapshot.keys))
    return RestorePlan(snapshot.job, values, expected, live, refusals, sorted(unchanged), extra,
                       clamped, revision)


def apply(store: Store, restore: RestorePlan) -> int:
    """Write the plan: one transaction when it fits etcd's limit, else batches with the
    pacing keys first. Each batch holds only if its keys are as the plan read them.
    Returns the number of transactions; raises RuntimeError when etcd changed meanwhile."""
    keys = JobKeys(restore.job)
    batches = restore.batches()
    for n, batch in enumerate(batches):
        ok = store.put_all({keys.prefix + k: restore.values[k] for k in batch},
                           {keys.prefix + k: restore.expected[k] for k in batch})
        if not ok:
            raise RuntimeError(f"keys changed in etcd while restoring (transaction {n + 1} of {len(batches)}, "
                               f"{n * MAX_TXN_OPS} keys written); nothing of that transaction was "
                               "written: run restore again")
    return len(batches)


def _clamp_terms(rel: str, value: Any, revision: int) -> tuple[Any, str]:
    """A fencing term is an etcd revision of the cluster that issued it (docs/operations/failsafe.md).
    In a fresh etcd the revisions start again at 1, and a term above the revision would
    fence every trainer elected there until etcd's revision passed it. Such a term is set
    to 0, "no fence": older than any leader elected from now on, and the same on every
    restore of the file (a term lowered to the revision of the restore would be raised by
    the next one, above a leader elected in between)."""
    if not isinstance(value, dict) or not (rel == names.WEIGHTS_LATEST or rel.startswith(names.TERM + "/")):
        return value, ""
    fields = [f for f in ("term", "reign") if type(value.get(f)) is int and value[f] > revision]
    if not fields:
        return value, ""
    note = f"{rel}: " + ", ".join(f"{f} {value[f]} -> 0" for f in fields)
    return {**value, **{f: 0 for f in fields}}, note
