"""The trainer's parts on a full disk (docs/operations/disk-full.md). The pure parts (reasons, the
retry) in process; the files (checkpoint folder, journal, metrics.jsonl) on a REAL small
tmpfs filled to the last byte (needs root: skipped otherwise, saying so).
tests/integration/test_trainer_disk_full.py runs the whole trainer through it."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import threading
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from rlfleet.daemons.trainer.checkpointing import (
    Checkpointer,
    CheckpointWriteError,
    checkpoints,
    failure_reason,
    write_checkpoint,
)
from rlfleet.daemons.trainer.journal import ExperienceJournal, JournalUnwritable, until_written
from rlfleet.daemons.trainer.metrics_log import MetricsLog, io_reason
from rlfleet.daemons.trainer.sim_learner import SimLearner

from .conftest import scored
from .test_parts import FakeLearner, Recorder, make_loop

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs (a real full filesystem) needs root")


@pytest.fixture
def small_fs(tmp_path):
    """A 512 KiB tmpfs; ``fill(leave)`` takes all but ``leave`` bytes, ``free()`` gives them back."""
    root = tmp_path / "fs"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(root)], check=True)

    class Fs:
        path = root

        def fill(self, leave: int = 0) -> None:
            with open(root / "ballast", "ab", buffering=0) as f:
                while (room := os.statvfs(root).f_bavail * os.statvfs(root).f_frsize - leave) > 0:
                    try:
                        f.write(b"\0" * min(room, 64 << 10))
                    except OSError as exc:
                        assert exc.errno == errno.ENOSPC
                        break

        def free(self) -> None:
            (root / "ballast").unlink()
    try:
        yield Fs()
    finally:
        subprocess.run(["umount", str(root)], check=True)


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# -- pure ------------------------------------------------------------------------------
def test_failure_reasons_tell_a_full_disk_from_other_errors():
    assert io_reason(OSError(errno.ENOSPC, "No space left on device")) == "no_space"
    assert io_reason(OSError(errno.EDQUOT, "Disk quota exceeded")) == "no_space"
    assert io_reason(OSError(errno.EIO, "Input/output error")) == "io_error"
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "full")
    assert io_reason(wrapped) == "no_space"
    plenty = 10 << 30
    assert failure_reason(OSError(errno.EIO, "x"), plenty) == "io_error"
    assert failure_reason(OSError(errno.EIO, "x"), 0) == "no_space"  # failed on a full disk
    # the serialisers' own exceptions (safetensors, torch.save) carry no errno
    assert failure_reason(Exception("I/O error: No space left on device (os error 28)"), plenty) == "no_space"
    assert failure_reason(RuntimeError("PytorchStreamWriter failed writing file data/0"), plenty) == "io_error"
    assert failure_reason(RuntimeError("unexpected pos 852928 vs 852820"), 4096) == "no_space"
    assert failure_reason(TypeError("a bug in fill"), plenty) is None  # raised as it is
    assert failure_reason(KeyboardInterrupt(), 0) is None


def test_until_written_retries_until_the_write_succeeds_and_gives_up_when_stopped(monkeypatch):
    monkeypatch.setattr("rlfleet.daemons.trainer.journal.RETRY_S", (0.01, 0.02))
    tries, why = [], []

    def write():
        tries.append(1)
        if len(tries) < 4:
            raise OSError(errno.ENOSPC, "No space left on device")

    assert until_written(write, threading.Event(), why.append) and len(tries) == 4
    assert why == ["no_space: [Errno 28] No space left on device"] * 3
    def fail():
        raise OSError(errno.EIO, "Input/output error")

    stop = threading.Event()
    stop.set()
    assert not until_written(fail, stop, why.append) and why[-1].startswith("io_error: ")


def test_a_failed_checkpoint_is_retried_a_whole_interval_later():
    c = Checkpointer.__new__(Checkpointer)
    c.failed_version = 6
    assert [v for v in range(6, 12) if c.retry_due(v, 4)] == [10, 11]


# -- on a real full filesystem ------------------------------------------------------------
@needs_root
def test_a_checkpoint_on_a_full_disk_leaves_no_partial_folder_and_keeps_the_previous_one(small_fs):
    root = small_fs.path / "checkpoints"
    first = write_checkpoint(root, 2, lambda d: (d / "trainer_state.json").write_text('{"version": 2}'))
    big = os.urandom(256 << 10)

    def fill(d: Path) -> None:
        (d / "model.bin").write_bytes(big)
        (d / "trainer_state.json").write_text('{"version": 4}')

    small_fs.fill(leave=128 << 10)
    with pytest.raises(CheckpointWriteError) as caught:
        write_checkpoint(root, 4, fill)
    e = caught.value
    assert e.reason == "no_space" and e.folder == root / "step-00000004"
    assert e.free_at_failure < (8 << 10) and e.free_after >= (120 << 10)  # the partial's space is back
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002"] and checkpoints(root) == [first]
    # A bug in fill is no disk failure: raised as it is, its folder removed all the same.
    small_fs.free()
    with pytest.raises(ZeroDivisionError):
        write_checkpoint(root, 4, lambda d: 1 / 0)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002"]


class _Store:
    def __init__(self) -> None:
        self.puts: list[tuple[str, dict]] = []

    def put(self, key, value):
        self.puts.append((key, value))


@needs_root
def test_the_checkpointer_counts_a_failure_says_why_and_clears_it_after_a_success(small_fs, tiny_model):
    folder = small_fs.path / "checkpoints"
    folder.mkdir()
    (folder / ".tmp-step-00000009-4242").mkdir()  # a trainer killed while writing one
    learner = SimLearner(tiny_model, time_scale=1.0, tokens_per_s=1.0, fixed_s=0.0, weight_mib=1)
    with ExperienceJournal(small_fs.path / "journal.bin", fsync=False) as journal:
        store = _Store()
        c = Checkpointer(learner, journal, folder, store=store, key="k", is_leader=lambda: True)
        assert not (folder / ".tmp-step-00000009-4242").exists()  # swept by the lock holder
        assert c.save(2) == folder / "step-00000002"
        before = metric("rlfleet_trainer_checkpoint_failures_total", id="", reason="no_space")
        small_fs.fill()
        assert c.save(4) is None  # no exception: training goes on
        assert metric("rlfleet_trainer_checkpoint_failures_total", id="", reason="no_space") == before + 1
        assert c.error.startswith("checkpoint of version 4 failed (no_space: ") and "keeping step-00000002" in c.error
        assert c.failed_version == 4 and [k for k, _ in store.puts] == ["k"]  # no record for the failure
        assert sorted(p.name for p in folder.iterdir()) == ["step-00000002"]
        small_fs.free()
        assert c.save(6) == folder / "step-00000006" and c.error == ""


@needs_root
def test_the_journal_on_a_full_disk_refuses_whole_records_and_recovers(small_fs):
    path = small_fs.path / "journal.bin"
    with ExperienceJournal(path) as j:
        j.append_trajectories([scored(0, 0, 1.0)])
        size = path.stat().st_size
        small_fs.fill()
        # the file's last page may still take a small record: write until it does not
        with pytest.raises(OSError) as caught:
            for k in range(1, 200):
                j.append_trajectories([scored(k, 0, 1.0, tokens=tuple(range(200)))])
        assert caught.value.errno == errno.ENOSPC
        assert j.write_error.startswith("journal: no_space: ")
        assert metric("rlfleet_trainer_journal_blocked", id="") == 1
        size = path.stat().st_size
        ids = set(j.state.pending)
        with pytest.raises(OSError):
            j.compact(0)  # needs room for a copy: fails, leaves no .compact file behind
        assert sorted(p.name for p in small_fs.path.iterdir()) == ["ballast", "journal.bin"]
        assert path.stat().st_size == size and set(j.state.pending) == ids
        small_fs.free()
        j.append_trajectories([scored(500, 0, 1.0)])
        assert j.write_error == "" and metric("rlfleet_trainer_journal_blocked", id="") == 0
    with ExperienceJournal(path) as j:  # nothing torn: every record written replays
        assert set(j.state.pending) == ids | {"p500"}


@needs_root
def test_metrics_lines_on_a_full_disk_are_skipped_whole_not_torn(small_fs):
    log = MetricsLog(small_fs.path / "metrics.jsonl")
    line = {"step": 1, "reward_mean": 0.5, "tokens_per_s": 1.0, "tokens": 3, "wait_s": 0.0,
            "staleness": {}, "pad": "x" * 3000}
    log.append(line)
    small_fs.fill()
    for step in range(2, 10):
        log.append({**line, "step": step})  # no exception: training goes on
    assert log.error.startswith("no_space: ")
    small_fs.free()
    log.append({**line, "step": 10})
    assert log.error == ""
    steps = [json.loads(x)["step"] for x in (small_fs.path / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] == 1 and steps[-1] == 10 and steps == sorted(steps)


# -- the training step ---------------------------------------------------------------------
def test_a_step_the_journal_cannot_record_is_neither_published_nor_checkpointed(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setattr("rlfleet.daemons.trainer.journal.RETRY_S", (0.01, 0.02))
    with ExperienceJournal(tmp_path / "j.bin", fsync=False) as journal:
        journal.append_trajectories([scored(p, k, 1.0) for p in (0, 1) for k in (0, 1)])
        learner, recorder = FakeLearner(), Recorder()
        loop = make_loop(tmp_path, tiny_model, journal, learner, recorder)
        real = journal._file
        fails = []

        class Full:  # the journal file on a disk with no room left, until freed
            def __getattr__(self, name):
                return getattr(real, name)

            def write(self, data):
                fails.append(1)
                if len(fails) > 2:
                    stop.set()  # the trainer is stopped meanwhile (a drain, a lost lease)
                raise OSError(errno.ENOSPC, "No space left on device")
        journal._file = Full()
        stop = threading.Event()
        loop._stop = stop
        with pytest.raises(JournalUnwritable, match="could record step 1"):
            loop.step(["p0", "p1"], Counter({0: 4}), wait_s=0.0)
        assert loop.state.status.startswith("stalled: journal: no_space")
        assert recorder.calls == [] and loop.state.version == 0  # not published, not checkpointed
        assert set(journal.state.pending) == {"p0", "p1"}  # the next leader trains them
