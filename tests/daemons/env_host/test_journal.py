"""The env-host journal: replay after a restart, torn writes, compaction."""

from __future__ import annotations

import json

import pytest

from rlfleet.common.wire.arrays import Float32Array, Int32Array
from rlfleet.common.wire.messages import Prompt, Trajectory, Turn
from rlfleet.daemons.env_host.journal import TrajectoryJournal, journal_path, turn_from_json, turn_to_json

G = 2


def turn(n: int) -> Turn:
    # 0.1 is not exact in float32: the round trip must still be bit-exact.
    return Turn(Int32Array([1, 5, n]), Int32Array([7, 2]), Float32Array([-0.1, -1e-7]), n, f"obs{n}", "R")


PROMPT = Prompt("frozenlake", "train", "frozenlake-train-0-0-x", "SFFF\nFHFH\nFFFH\nHFFG", "", 3)


def done(tid: str, prompt_id: int, turns: list[Turn], reason: str = "", prompt=None) -> Trajectory:
    return Trajectory(tid, prompt_id, f"p{prompt_id}", "frozenlake", turns, 1.0,
                      {"turns": str(len(turns))}, reason, prompt=prompt)


def test_replay_restores_every_state(tmp_path):
    path = tmp_path / "env-0.jsonl"
    j = TrajectoryJournal(path, G)
    j.record_claim(range(0, 3))
    j.record_turn("p0-g0", 0, turn(0))
    j.record_done(done("p0-g0", 0, [turn(0)]))
    j.record_acked(["p0-g0"])
    j.record_turn("p0-g1", 0, turn(0))
    j.record_done(done("p0-g1", 0, [turn(0)], reason="env_error"))  # done, not acked
    j.record_turn("p1-g0", 0, turn(0))
    j.record_turn("p1-g0", 1, turn(1))  # partial
    j.close()

    j = TrajectoryJournal(path, G)
    assert j.live_prompts() == [0, 1, 2] and j.claimed_to == 3
    assert j.status("p0-g0") == "acked"
    assert j.status("p0-g1") == "done"
    assert j.finished("p0-g1") == done("p0-g1", 0, [turn(0)], reason="env_error")
    # The prompt is not journaled: the caller has it from the prompt stream.
    assert j.finished("p0-g1", PROMPT) == done("p0-g1", 0, [turn(0)], "env_error", PROMPT)
    assert j.status("p1-g0") == "partial" and j.turns("p1-g0") == [turn(0), turn(1)]
    assert j.status("p1-g1") == "fresh" and j.status("p2-g0") == "fresh"
    assert j.status("p9-g0") == "acked"  # never ours / long forgotten: nothing to do

    j.record_acked(["p0-g1"])  # the whole group of prompt 0 is acked: forgotten
    assert j.live_prompts() == [1, 2]
    j.close()
    j = TrajectoryJournal(path, G)
    assert j.live_prompts() == [1, 2] and j.claimed_to == 3
    assert "p0-g0" not in path.read_text()  # compacted away on open
    j.close()


def test_turn_json_round_trip_is_exact():
    t = turn(3)
    assert turn_from_json(json.loads(json.dumps(turn_to_json(t)))) == t


def test_resumed_trajectory_that_restarts_truncates_its_turns(tmp_path):
    j = TrajectoryJournal(tmp_path / "j.jsonl", G)
    j.record_claim(range(0, 1))
    for n in range(3):
        j.record_turn("p0-g0", n, turn(n))
    j.record_turn("p0-g0", 0, turn(9))  # replay diverged: the episode restarted
    assert j.turns("p0-g0") == [turn(9)]
    with pytest.raises(ValueError, match="p0-g0: 2 turns, journal has 1"):
        j.record_done(done("p0-g0", 0, [turn(9), turn(1)]))
    # Restarted and dropped before its first new turn: the old turns must not be re-sent.
    j.record_claim(range(1, 2))
    j.record_turn("p1-g0", 0, turn(0))
    j.record_done(done("p1-g0", 1, [], reason="env_error"))
    assert j.finished("p1-g0").turns == []
    j.close()
    assert TrajectoryJournal(tmp_path / "j.jsonl", G).finished("p1-g0").turns == []


def test_torn_and_corrupt_lines_cost_only_themselves(tmp_path):
    path = tmp_path / "j.jsonl"
    j = TrajectoryJournal(path, G)
    j.record_claim(range(0, 2))
    j.record_turn("p1-g1", 0, turn(0))
    j.close()
    with open(path, "ab") as f:
        f.write(b'{"t":"garbage"}\n')
        f.write(b'{"t":"turn","id":"p1-g1","n":1,"turn":{"p":[1],"t":[2]')  # kill -9 mid-write
    j = TrajectoryJournal(path, G)
    assert j.skipped == 2
    assert j.live_prompts() == [0, 1] and j.turns("p1-g1") == [turn(0)]
    j.record_turn("p1-g1", 1, turn(1))  # appending after a torn line still works
    j.close()
    assert TrajectoryJournal(path, G).turns("p1-g1") == [turn(0), turn(1)]


def test_claimed_to_survives_compaction_of_completed_prompts(tmp_path):
    # It tells a restarted env-host which cursor ranges it already knew about.
    path = tmp_path / "j.jsonl"
    j = TrajectoryJournal(path, G, compact_min_records=4)
    j.record_claim(range(0, 4))
    for p in range(4):
        for k in range(G):
            tid = f"p{p}-g{k}"
            j.record_turn(tid, 0, turn(0))
            j.record_done(done(tid, p, [turn(0)]))
            j.record_acked([tid])
    assert j.live_prompts() == [] and j.claimed_to == 4
    j.close()
    assert len(path.read_text().splitlines()) == 1  # only the mark is left
    assert TrajectoryJournal(path, G).claimed_to == 4


def test_late_duplicate_ack_of_a_forgotten_prompt_is_ignored(tmp_path):
    j = TrajectoryJournal(tmp_path / "j.jsonl", G)
    j.record_claim(range(0, 1))
    for k in range(G):
        j.record_turn(f"p0-g{k}", 0, turn(0))
        j.record_done(done(f"p0-g{k}", 0, [turn(0)]))
    j.record_acked([f"p0-g{k}" for k in range(G)])
    j.record_acked(["p0-g0"])
    assert j.trajectories == {} and j.live_prompts() == []


def test_journal_path_prefers_the_run_dir(tmp_path, monkeypatch):
    from rlfleet.common.spec.job import parse_spec

    from .fakes import tokenizer_dir

    spec = parse_spec({"job": {"name": "jp", "runs_dir": str(tmp_path / "runs")},
                       "model": {"path": str(tokenizer_dir())}, "task": {"env": {"kind": "arithmetic"}}})
    monkeypatch.delenv("RLFLEET_RUN_DIR", raising=False)
    assert journal_path(spec, "e1") == tmp_path / "runs" / "jp" / "env-host" / "e1.jsonl"
    monkeypatch.setenv("RLFLEET_RUN_DIR", str(tmp_path / "run"))
    assert journal_path(spec, "e1") == tmp_path / "run" / "env-host" / "e1.jsonl"


def test_handed_counts_only_undropped_trajectories_as_good_across_a_restart(tmp_path):
    """After a restart the runner rebuilds each prompt's group from these counts: a
    handed-on trajectory that was dropped (env_error) must not count towards a whole
    group, else a redundant round closes one group early."""
    path = tmp_path / "env-0.jsonl"
    j = TrajectoryJournal(path, 3)  # what a prompt launches: group_size 2 + 1 redundant sample
    j.record_claim(range(0, 1))
    for k, reason in enumerate(["", "env_error"]):
        j.record_turn(f"p0-g{k}", 0, turn(0))
        j.record_done(done(f"p0-g{k}", 0, [turn(0)], reason=reason))
    j.record_acked(["p0-g0", "p0-g1"])
    j.record_turn("p0-g2", 0, turn(0))  # still running: the prompt stays live
    assert j.handed(0) == (2, 1)
    j.close()
    j = TrajectoryJournal(path, 3)  # replayed and compacted: the acked trajectories keep their reason
    assert j.handed(0) == (2, 1)
    j.close()


def test_a_full_file_leaves_no_torn_line_and_keeps_what_it_could_not_write(tmp_path):
    """A short write (here RLIMIT_FSIZE, as a full disk does it) used to leave half a line
    that the next append continued, and replay skipped both records: the part is cut back
    off, the lines are kept and written once there is room."""
    import subprocess
    import sys
    script = f"""
import os, resource, signal
from rlfleet.daemons.env_host.journal import TrajectoryJournal
from tests.daemons.env_host.test_journal import turn
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a short write / EFBIG instead of a kill
path = {str(tmp_path / "env-0.jsonl")!r}
j = TrajectoryJournal(path, 2)
j.record_claim(range(0, 2))
j.record_turn("p0-g0", 0, turn(0))
size = os.path.getsize(path)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 40, hard))  # room for 40 bytes of a longer line
try:
    j.record_turn("p0-g0", 1, turn(1))
    print("no error")
except OSError as exc:
    print("refused:", exc)
assert os.path.getsize(path) == size, "the part written was not cut back off"
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # room again
j.record_turn("p0-g1", 0, turn(0))  # writes the kept line first, then this one
j.close()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[3]))
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout and "journal lines not written (no_space); kept for the next write" in out.stdout
    j = TrajectoryJournal(tmp_path / "env-0.jsonl", G)
    assert j.skipped == 0 and j.turns("p0-g0") == [turn(0), turn(1)] and j.turns("p0-g1") == [turn(0)]
