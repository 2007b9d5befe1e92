"""Disk full on the trainer (docs/operations/disk-full.md), on a REAL full filesystem: the trainer's
checkpoint folder (its checkpoints and its journal) is a small tmpfs, filled with a
ballast file while `rlfleet run` trains the tiny model, then freed.

Phases, each waited for on a condition:
  1. a first checkpoint is written;
  2. the filesystem is filled to less than a checkpoint: the next checkpoints fail
     (counted, `checkpoint_error` in the member record, no partial folder, the previous
     one kept) and training goes on;
  3. it is filled completely: the journal cannot be written, the trainer says so
     (`journal_error`, status `stalled: ...`, the blocked gauge) and trains nothing;
  4. the ballast is removed: the journal and the next checkpoint succeed, the errors
     clear; stopped then (SIGTERM), the run exits 7 with the accounting invariant held.
The recovery times printed (pytest -s) are the figures of docs/operations/disk-full.md.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from rlfleet.common.control.cluster import Cluster
from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.tools.exit_codes import Exit

from .helpers import TINY_MODEL, rlfleet, stop, wait_for, write_spec

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs (a real full filesystem) needs root"),
    pytest.mark.skipif(not (TINY_MODEL / "tokenizer.json").exists(), reason="models/tiny-qwen2 not built"),
]

JOB = """\
group_size = 4
eval_size = 4
eval_every_steps = 1000

[trainer]
batch_size = 8
max_steps = 100000  # stopped by the test once the trainer has recovered
checkpoint_every = 2

[env_host]
max_concurrent = 16
"""

TMPFS_BYTES = 24 << 20  # two checkpoints of the tiny model (~1.7 MB each), one in progress, and
# the journal, which grows while no checkpoint lets it be compacted (~4 KB a trajectory)
SLACK_BYTES = 768 << 10  # phase 2: room for the journal's appends, not for a checkpoint


def _mount(folder: Path) -> None:
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(folder)], check=True)


def _unmount(folder: Path) -> None:
    if subprocess.run(["mountpoint", "-q", str(folder)]).returncode == 0:
        if subprocess.run(["umount", str(folder)]).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], check=True)  # a process still holds a file


def _fill(folder: Path, name: str, leave: int) -> Path:
    """A ballast file taking all but ``leave`` free bytes (0: until the filesystem refuses)."""
    path = folder / name
    chunk = b"\0" * (64 << 10)
    with open(path, "wb", buffering=0) as f:
        while True:
            room = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize - leave
            if room <= 0:
                break
            try:
                f.write(chunk[:min(len(chunk), room)])
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
    return path


def _trainer(store: EtcdStore, job: str):
    return Cluster.read(store, job).leader_member("trainer")


def _metric(member, name: str) -> float:
    text = urllib.request.urlopen(member.metrics, timeout=10).read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def test_trainer_survives_a_full_disk_and_recovers_when_space_is_freed(tmp_path, etcd):
    job = "diskfull"
    spec = write_spec(tmp_path, job=job, extra=JOB)
    log = tmp_path / "run.log"
    store = EtcdStore(etcd.endpoints)
    base = tmp_path / "runs" / job
    ckpts: Path | None = None
    proc = rlfleet("run", str(spec), "--insecure", "--etcd", etcd.endpoints_arg, "--no-view",
                   "--give-up-after", "0/60", log=log)
    try:
        # The run makes runs/<job>/<stamp>/; its trainer opens checkpoints/ after its
        # interpreter starts (over a second): mount the tmpfs there before that.
        run_dir = wait_for("the run dir", lambda: next(iter(base.glob("*")), None), 60, every_s=0.005)
        ckpts = run_dir / "checkpoints"
        _mount(ckpts)
        wait_for("the trainer's journal on the tmpfs", lambda: (ckpts / "journal.bin").exists(), 120)

        # 1. a first complete checkpoint
        first = wait_for("a first checkpoint", lambda: sorted(ckpts.glob("step-*")), 240)[-1]

        # 2. less room than a checkpoint: checkpoints fail, training goes on
        ballast = [_fill(ckpts, "ballast-1", SLACK_BYTES)]
        failed = wait_for("a failed checkpoint in the member record",
                          lambda: (m := _trainer(store, job)) and m.info.get("checkpoint_error") and m, 120)
        failed_at = failed.info["version"]
        assert "no_space" in failed.info["checkpoint_error"], failed.info
        wait_for("training to go on past the failed checkpoint",
                 lambda: _trainer(store, job).info["version"] >= failed_at + 3, 120)
        # The failed checkpoints' partial folders are removed; only the next try (a newer
        # version, every checkpoint_every steps) may be in progress at this moment.
        last_failed = int(re.search(r"checkpoint of version (\d+) failed",
                                    _trainer(store, job).info["checkpoint_error"]).group(1))
        partial = [int(re.match(r"\.tmp-step-(\d+)-", p.name).group(1)) for p in ckpts.glob(".tmp-*")]
        assert len(partial) <= 1 and all(v > last_failed for v in partial), (last_failed, list(ckpts.iterdir()))
        kept = sorted(ckpts.glob("step-*"))
        assert first in kept and all((p / "trainer_state.json").is_file() for p in kept), kept
        assert _metric(failed, "rlfleet_trainer_checkpoint_failures_total") >= 1
        assert 'reason="no_space"' in urllib.request.urlopen(failed.metrics, timeout=10).read().decode()

        # 3. no room at all: the journal cannot be written; nothing is trained or acked
        ballast.append(_fill(ckpts, "ballast-2", 0))
        blocked = wait_for("the journal error in the member record",
                           lambda: (m := _trainer(store, job)) and m.info.get("journal_error") and m, 120)
        # Records small enough for the journal file's last page may still go in (a step
        # that was under way may finish): wait until the version holds still across three
        # more failed writes, and from then on it must not move.
        def held_across_three_failures() -> tuple[int] | None:
            version = _trainer(store, job).info["version"]
            failures = _metric(blocked, "rlfleet_trainer_journal_write_failures_total")
            wait_for("three more failed journal writes",
                     lambda: _metric(blocked, "rlfleet_trainer_journal_write_failures_total") >= failures + 3, 60)
            return (version,) if _trainer(store, job).info["version"] == version else None
        (held_version,) = wait_for("training held by the journal", held_across_three_failures, 180)
        failures = _metric(blocked, "rlfleet_trainer_journal_write_failures_total")
        wait_for("three more failed journal writes (held)",
                 lambda: _metric(blocked, "rlfleet_trainer_journal_write_failures_total") >= failures + 3, 60)
        now = _trainer(store, job)
        assert now.info["version"] == held_version, (held_version, now.info)
        assert now.info["training"].startswith("stalled: journal: no_space"), now.info
        assert _metric(now, "rlfleet_trainer_journal_blocked") == 1

        # 4. space freed: journal, training and checkpoints come back by themselves
        for b in ballast:
            b.unlink()
        freed = time.monotonic()
        wait_for("the journal error to clear", lambda: "journal_error" not in _trainer(store, job).info, 60)
        journal_back_s = time.monotonic() - freed
        wait_for("a training step after the outage", lambda: _trainer(store, job).info["version"] > held_version, 120)
        step_back_s = time.monotonic() - freed
        wait_for("the checkpoint error to clear", lambda: "checkpoint_error" not in _trainer(store, job).info, 120)
        checkpoint_back_s = time.monotonic() - freed
        print(f"\nrecovery after freeing space: journal {journal_back_s:.1f} s, first step "
              f"{step_back_s:.1f} s, checkpoint {checkpoint_back_s:.1f} s")
        assert _metric(_trainer(store, job), "rlfleet_trainer_journal_blocked") == 0

        rc = stop(proc, 120)
        out = log.read_text()
        assert rc == Exit.STOPPED, out[-4000:]
        assert "invariant holds" in out, out[-4000:]
        assert not list(ckpts.glob(".tmp-*")) and len(list(ckpts.glob("step-*"))) == 2
        newest = json.loads((max(ckpts.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
                             / "trainer_state.json").read_text())
        assert newest["version"] > held_version, (newest, held_version)  # written after the outage
        trainer_log = (run_dir / "logs" / "trainer-0.log").read_text()
        assert re.search(r"checkpoint \S+step-\d+ not written \(no_space: .*\): \d+ bytes free", trainer_log)
        assert "nothing is acked or trained until it can be written" in trainer_log
    finally:
        stop(proc, 60)
        if ckpts is not None:
            _unmount(ckpts)
