"""The experience journal: replay, torn tails, corruption, duplicates, compaction,
and that a trajectory is on disk when append returns (a child killed right after)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlfleet.daemons.trainer.journal import ExperienceJournal, JournalCorrupt, JournalLocked

from .conftest import scored


def ids(journal: ExperienceJournal) -> dict[str, list[str]]:
    return {g: sorted(ts) for g, ts in journal.state.pending.items()}


def test_replay_rebuilds_pending_trained_dropped(tmp_path):
    path = tmp_path / "journal.bin"
    with ExperienceJournal(path) as j:
        assert j.append_trajectories([scored(0, 0, 1.0), scored(0, 1, 0.0), scored(1, 0, 0.5)]) == [True] * 3
        assert j.append_trajectories([scored(2, 0, 0.5), scored(3, 0, 0.5)]) == [True, True]
        j.record_trained(1, ["p0"])
        assert j.record_dropped([("p2", "staleness", "p2-g0: staleness 5 > 2")]) == 1
        live = (ids(j), dict(j.state.trained), dict(j.state.dropped), j.state.max_version)
    with ExperienceJournal(path) as j:
        assert (ids(j), dict(j.state.trained), dict(j.state.dropped), j.state.max_version) == live
        assert ids(j) == {"p1": ["p1-g0"], "p3": ["p3-g0"]}
        assert j.state.trained == {"p0": 1}
        assert j.state.dropped == {"p2": ("staleness", "p2-g0: staleness 5 > 2")}
        # The replayed trajectory is the one that was written, arrays included.
        st = j.group("p1")[0]
        assert st.reward == 0.5 and st.trajectory.turns[0].token_ids.tolist() == [7, 8]
        assert st.trajectory.turns[0].logprobs.tolist() == [-1.0, -1.0]


def test_duplicates_are_ignored_and_not_written(tmp_path):
    path = tmp_path / "journal.bin"
    with ExperienceJournal(path) as j:
        assert j.append_trajectories([scored(0, 0, 1.0), scored(0, 0, 1.0)]) == [True, False]
        size = j.size_bytes()
        assert j.append_trajectories([scored(0, 0, 1.0)]) == [False]
        j.record_trained(1, ["p0"])
        j.record_dropped([("p5", "env_error", "")])
        # A late copy of a trajectory of a trained or dropped group is a duplicate too.
        assert j.append_trajectories([scored(0, 1, 0.0), scored(5, 3, 0.0)]) == [False, False]
        assert j.size_bytes() > size  # only the trained/dropped records were added
        assert j.record_dropped([("p5", "other", "")]) == 0  # the first reason wins
    with ExperienceJournal(path) as j:
        assert j.state.dropped["p5"] == ("env_error", "")
        assert j.state.pending == {}


@pytest.mark.parametrize("cut", [1, 5, 9, -1])
def test_torn_last_record_is_truncated(tmp_path, cut):
    path = tmp_path / "journal.bin"
    with ExperienceJournal(path) as j:
        j.append_trajectories([scored(0, 0, 1.0)])
        good = j.size_bytes()
        j.append_trajectories([scored(0, 1, 0.0)])
        full = j.size_bytes()
    # A crash mid-write leaves a prefix of the last record (cut bytes of it short).
    with open(path, "r+b") as f:
        f.truncate(full - (full - good - cut if cut > 0 else 1))
    torn = path.stat().st_size
    with ExperienceJournal(path) as j:
        assert ids(j) == {"p0": ["p0-g0"]}
        assert j.truncated_bytes == torn - good
        assert path.stat().st_size == good
        # The journal stays appendable after the repair.
        assert j.append_trajectories([scored(0, 1, 0.0)]) == [True]
    with ExperienceJournal(path) as j:
        assert ids(j) == {"p0": ["p0-g0", "p0-g1"]}


def test_flipped_bit_in_last_record_is_a_torn_write(tmp_path):
    path = tmp_path / "journal.bin"
    with ExperienceJournal(path) as j:
        j.append_trajectories([scored(0, 0, 1.0)])
        good = j.size_bytes()
        j.append_trajectories([scored(0, 1, 0.0)])
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with ExperienceJournal(path) as j:
        assert ids(j) == {"p0": ["p0-g0"]} and path.stat().st_size == good


def test_corruption_in_the_middle_is_refused_and_nothing_truncated(tmp_path):
    path = tmp_path / "journal.bin"
    with ExperienceJournal(path) as j:
        j.append_trajectories([scored(0, 0, 1.0)])
        j.append_trajectories([scored(0, 1, 0.0)])
    data = bytearray(path.read_bytes())
    data[20] ^= 0xFF  # inside the first record's payload
    path.write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt, match="corrupt record at byte 0: crc mismatch"):
        ExperienceJournal(path)
    assert path.read_bytes() == bytes(data)


def test_one_process_at_a_time(tmp_path):
    with ExperienceJournal(tmp_path / "journal.bin"):
        with pytest.raises(JournalLocked):
            ExperienceJournal(tmp_path / "journal.bin")
    ExperienceJournal(tmp_path / "journal.bin").close()  # released on close


def test_reopen_after_resume_and_compaction(tmp_path):
    path = tmp_path / "journal.bin"
    with ExperienceJournal(path) as j:
        for p in range(4):
            j.append_trajectories([scored(p, k, float(k)) for k in range(2)])
        j.record_trained(1, ["p0"])
        j.record_trained(2, ["p1"])
        j.record_dropped([("p3", "staleness", "")])
        before = j.size_bytes()
        saved = j.compact(1)  # a checkpoint covers version 1
        assert saved > 0 and j.size_bytes() == before - saved
        assert "p0" not in j.state.trained_data and "p1" in j.state.trained_data
    with ExperienceJournal(path) as j:
        assert j.state.trained == {"p0": 1, "p1": 2}
        assert j.state.dropped == {"p3": ("staleness", "")}
        assert ids(j) == {"p2": ["p2-g0", "p2-g1"]}
        assert j.append_trajectories([scored(0, 0, 1.0), scored(3, 1, 0.0)]) == [False, False]
        # Resuming from the version-1 checkpoint: p1's step was lost, train it again.
        assert j.reopen_trained_after(1) == {2: ["p1"]}  # by the version that trained it
        assert j.state.max_version == 2
    with ExperienceJournal(path) as j:  # the reopening is durable
        assert j.state.trained == {"p0": 1}
        assert ids(j) == {"p1": ["p1-g0", "p1-g1"], "p2": ["p2-g0", "p2-g1"]}
        assert j.complete_groups(2) == ["p1", "p2"]  # p1 keeps its place: it is the older one


CHILD = textwrap.dedent("""
    import os, signal, sys
    from rlfleet.daemons.trainer.journal import ExperienceJournal
    from tests.daemons.trainer.conftest import scored
    j = ExperienceJournal(sys.argv[1])
    assert j.append_trajectories([scored(7, 0, 1.0), scored(7, 1, 0.0)]) == [True, True]
    os.kill(os.getpid(), signal.SIGKILL)  # where the ack would be sent
""")


def test_appended_trajectories_survive_kill_9_right_after_append(tmp_path):
    path = tmp_path / "journal.bin"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path)], cwd=Path(__file__).parents[3],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    with ExperienceJournal(path) as j:
        assert ids(j) == {"p7": ["p7-g0", "p7-g1"]}


def test_write_failure_leaves_no_half_record(tmp_path):
    path = tmp_path / "journal.bin"
    with ExperienceJournal(path) as j:
        j.append_trajectories([scored(0, 0, 1.0)])
        size = j.size_bytes()
        real_write = j._file.write

        def short_then_fail(data):  # a disk that fills up in the middle of a record
            if len(data) > 10:
                return real_write(bytes(data[:10]))
            raise OSError(28, "No space left on device")
        j._file = _Flaky(j._file, short_then_fail)
        with pytest.raises(OSError, match="No space"):
            j.append_trajectories([scored(0, 1, 0.0)])
        assert path.stat().st_size == size and ids(j) == {"p0": ["p0-g0"]}
        j._file = j._file.inner
        assert j.append_trajectories([scored(0, 1, 0.0)]) == [True]
    with ExperienceJournal(path) as j:
        assert ids(j) == {"p0": ["p0-g0", "p0-g1"]}


class _Flaky:
    def __init__(self, inner, write):
        self.inner, self.write = inner, write

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_fsync_happens_before_append_returns(tmp_path, monkeypatch):
    calls: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    with ExperienceJournal(tmp_path / "journal.bin") as j:
        calls.clear()
        j.append_trajectories([scored(0, 0, 1.0), scored(0, 1, 0.0)])
        assert calls == ["fsync"]  # one sync for the whole batch, before returning
        j.append_trajectories([scored(0, 0, 1.0)])
        assert calls == ["fsync"]  # a pure duplicate writes and syncs nothing
