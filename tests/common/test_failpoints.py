"""Test hooks in production code are named and parsed in common/failpoints.py only."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.common import failpoints

REPO = Path(__file__).resolve().parents[2]
SOURCE = [p for folder in ("common", "daemons", "relay", "tools") for p in (REPO / folder).rglob("*.py")]


def test_no_module_but_failpoints_reads_a_failpoint_variable():
    readers = [f"{p.relative_to(REPO)}: {name}" for p in SOURCE if p.name != "failpoints.py"
               for name in failpoints.NAMES if f'"{name}"' in p.read_text()]
    assert not readers
    assert len(SOURCE) > 100 and REPO / "common" / "failpoints.py" in SOURCE


def test_the_daemon_failpoint_names_one_role(monkeypatch):
    monkeypatch.setenv(failpoints.DAEMON, "exit_at_start:reward-host")
    assert failpoints.daemon_exits_at_start("reward-host") and not failpoints.daemon_exits_at_start("trainer")
    assert failpoints.daemon_stall_file("reward-host") is None
    monkeypatch.setenv(failpoints.DAEMON, "stall_if_file:repack-manager:/tmp/stall")
    assert failpoints.daemon_stall_file("repack-manager") == "/tmp/stall"
    assert failpoints.daemon_stall_file("rollout") is None
    monkeypatch.setenv(failpoints.DAEMON, "x-stall_if_file:repack-manager:/tmp/stall")
    assert failpoints.daemon_stall_file("repack-manager") is None


def test_unset_costs_nothing_and_does_nothing(monkeypatch):
    for name in failpoints.NAMES:
        monkeypatch.delenv(name, raising=False)
    failpoints.trainer_kill_at("mid_step", 3)  # still alive
    assert not failpoints.trainer_exits_after_journal() and not failpoints.repack_kills_mid_plan()
    assert (failpoints.trainer_step_delay_s(), failpoints.relay_pace_s()) == (0.0, 0.0)
    assert failpoints.relay_corrupt_chunks() == set()


def test_values_are_parsed_with_a_precise_error(monkeypatch):
    monkeypatch.setenv(failpoints.RELAY_CORRUPT, "1:1:3,2:1:0")
    assert failpoints.relay_corrupt_chunks() == {(1, 1, 3), (2, 1, 0)}
    monkeypatch.setenv(failpoints.RELAY_CORRUPT, "1:1")
    with pytest.raises(ValueError, match="RLFLEET_RELAY_CORRUPT items are version:layout:chunk, got '1:1'"):
        failpoints.relay_corrupt_chunks()
    monkeypatch.setenv(failpoints.RELAY_PACE_S, "0.01")
    assert failpoints.relay_pace_s() == 0.01
    monkeypatch.setenv(failpoints.RELAY_PACE_S, "nan")
    with pytest.raises(ValueError, match="RLFLEET_RELAY_PACE_S must be a number of seconds >= 0, got 'nan'"):
        failpoints.relay_pace_s()
