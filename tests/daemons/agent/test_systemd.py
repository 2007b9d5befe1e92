"""The systemd backend against a fake `systemctl` on PATH: a script that records every
call and answers `show` and `list-units` from files the test writes. What must be
right here is what the agent asks systemd (the command lines) and the environment
file a unit starts with; the real units are exercised on the lab (tools/lab/)."""

from __future__ import annotations

import os
import shlex
import stat
import tomllib
from pathlib import Path

import pytest

from rlfleet.common.control.placement import Placed
from rlfleet.common.spec.job import load_spec, parse_spec
from rlfleet.common.spec.seams import sandboxed_roles
from rlfleet.daemons.agent.daemon import unit_env
from rlfleet.daemons.agent.policy import CrashLoop
from rlfleet.daemons.agent.reconciler import Reconciler
from rlfleet.daemons.agent.sandbox_dropin import DROPIN_TEXT
from rlfleet.daemons.agent.systemd import SystemdBackend, death_phrase, env_file_text, parse_show

FAKE = """#!/bin/sh
# Fake systemctl: one line per call in $FAKE_DIR/calls; answers from $FAKE_DIR/<unit>.show.
echo "$*" >> "$FAKE_DIR/calls"
case "$1" in
  show) last=""; for a in "$@"; do last="$a"; done
        if [ -f "$FAKE_DIR/$last.show" ]; then cat "$FAKE_DIR/$last.show"
        else printf 'ActiveState=inactive\\nSubState=dead\\nNRestarts=0\\nExecMainStatus=0\\nResult=success\\n'; fi ;;
  list-units) [ -f "$FAKE_DIR/list-units" ] && cat "$FAKE_DIR/list-units" ;;
  start) [ -f "$FAKE_DIR/refuse-start" ] && { echo "Job failed" >&2; exit 1; } ;;
esac
exit 0
"""

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
ROLLOUT = Placed("h1", "rollout", "rollout-0")
UNIT = "rlfleet@arith:rollout-0.service"


class FakeSystemd:
    def __init__(self, tmp: Path) -> None:
        self.dir = tmp / "fake"
        self.dir.mkdir()
        exe = tmp / "bin" / "systemctl"
        exe.parent.mkdir()
        exe.write_text(FAKE)
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
        self.bin = exe.parent

    def calls(self) -> list[str]:
        path = self.dir / "calls"
        return path.read_text().splitlines() if path.exists() else []

    def state(self, unit: str, active: str, sub: str = "running", restarts: int = 0, status: int = 0,
              result: str = "success") -> None:
        (self.dir / f"{unit}.show").write_text(f"Result={result}\nActiveState={active}\nSubState={sub}\n"
                                               f"NRestarts={restarts}\nExecMainStatus={status}\n")


@pytest.fixture
def fake(tmp_path, monkeypatch) -> FakeSystemd:
    f = FakeSystemd(tmp_path)
    monkeypatch.setenv("PATH", f"{f.bin}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DIR", str(f.dir))
    return f


def backend(tmp_path: Path, env: dict[str, str] | None = None) -> SystemdBackend:
    return SystemdBackend("arith", "h1", env or {"RLFLEET_JOB": "arith"}, env_dir=tmp_path / "units")


def read_env_file(path: Path) -> dict[str, str]:
    """Read it back the way systemd does for these lines (shell-like quoting)."""
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = shlex.split(value)[0] if value else ""
    return out


def test_start_writes_the_env_file_then_starts_the_unit_without_blocking(fake, tmp_path, monkeypatch):
    for key in [k for k in os.environ if k.startswith("RLFLEET_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("RLFLEET_CURVE_DIR", "/etc/rlfleet/jobs/arith/curve")
    monkeypatch.setenv("RLFLEET_ROLE", "agent-leftover")  # never copied: each unit gets its own
    monkeypatch.setenv("HOME", "/root")  # not a job variable: not copied
    env = unit_env("arith", "10.0.0.1:2379,10.0.0.2:2379", "h1",
                   {"RLFLEET_ETCD_CACERT": "/etc/rlfleet/etcd/ca.pem", "RLFLEET_ETCD_USER": ""})
    b = backend(tmp_path, env)
    assert b.start(ROLLOUT) == UNIT
    assert fake.calls() == [f"start --no-block {UNIT}"]
    path = tmp_path / "units" / "arith:rollout-0.env"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    written = read_env_file(path)
    assert written == {"RLFLEET_JOB": "arith", "RLFLEET_ETCD": "10.0.0.1:2379,10.0.0.2:2379", "RLFLEET_HOST": "h1",
                       "RLFLEET_CURVE_DIR": "/etc/rlfleet/jobs/arith/curve",
                       "RLFLEET_ETCD_CACERT": "/etc/rlfleet/etcd/ca.pem",
                       "RLFLEET_ROLE": "rollout", "RLFLEET_MEMBER_ID": "rollout-0"}
    assert not list((tmp_path / "units").glob("*.tmp"))


def test_a_daemon_given_gpus_gets_them_in_its_env_file_and_one_given_none_gets_none(fake, tmp_path):
    b = backend(tmp_path, {"RLFLEET_JOB": "arith"})
    b.start(Placed("h1", "rollout", "rollout-0", gpus=(2, 3)))
    b.start(Placed("h1", "relay", "relay-0", gpus=()))  # the job assigns GPUs, this daemon none
    b.start(Placed("h1", "env-host", "env-host-0"))  # a job that assigns none: left alone
    read = {m: read_env_file(tmp_path / "units" / f"arith:{m}.env") for m in ("rollout-0", "relay-0", "env-host-0")}
    assert read["rollout-0"]["CUDA_VISIBLE_DEVICES"] == "2,3" and read["relay-0"]["CUDA_VISIBLE_DEVICES"] == ""
    assert "CUDA_VISIBLE_DEVICES" not in read["env-host-0"]


def test_env_file_quotes_what_systemd_would_otherwise_split():
    text = env_file_text({"A": "plain/path:1,2", "B": 'two words "quoted" \\ back', "C": ""})
    assert "A=plain/path:1,2\n" in text and 'B="two words \\"quoted\\" \\\\ back"\n' in text and "C=\n" in text
    with pytest.raises(ValueError, match="newline"):
        env_file_text({"D": "a\nb"})


def test_observe_counts_systemd_restarts_and_failures_as_deaths(fake, tmp_path):
    b = backend(tmp_path)
    fake.state(UNIT, "active")
    assert b.observe(ROLLOUT).active and b.observe(ROLLOUT).deaths == ()
    assert fake.calls()[-1] == f"show -p ActiveState,SubState,NRestarts,ExecMainStatus,Result {UNIT}"
    fake.state(UNIT, "activating", "auto-restart", restarts=2, status=1, result="exit-code")
    seen = b.observe(ROLLOUT)
    assert seen.active and seen.deaths == ("exit code 1; restarted by systemd",) * 2
    fake.state(UNIT, "failed", "failed", restarts=2, status=9, result="signal")
    seen = b.observe(ROLLOUT)
    assert not seen.active and seen.deaths == ("signal 9",)
    assert b.observe(ROLLOUT).deaths == ()  # told once
    # Starting a failed unit again: reset-failed first (systemd's start limit), then start.
    b.start(ROLLOUT)
    assert fake.calls()[-2:] == [f"reset-failed {UNIT}", f"start --no-block {UNIT}"]


def test_stop_and_existing_units(fake, tmp_path):
    b = backend(tmp_path)
    b.stop(ROLLOUT)
    assert fake.calls() == [f"stop --no-block {UNIT}"]
    (fake.dir / "list-units").write_text(
        f"{UNIT} loaded active running rlfleet arith rollout-0\n"
        "rlfleet@arith:relay-0.service loaded failed failed rlfleet arith relay-0\n"
        "rlfleet@other:trainer-0.service loaded active running another job\n")
    assert b.existing(frozenset({"h1"})) == [ROLLOUT]
    assert fake.calls()[-1] == "list-units --all --plain --no-legend --no-pager rlfleet@arith:*.service"
    assert b.release(10.0, print) == "units keep running under systemd"
    assert fake.calls()[-1].startswith("list-units")  # nothing stopped


def test_phrases():
    assert parse_show("A=1\nB=x=y\n") == {"A": "1", "B": "x=y"}
    assert death_phrase("exit-code", "3") == "exit code 3"
    assert death_phrase("core-dump", "11") == "signal 11, core dumped"
    assert death_phrase("watchdog", "6") == "watchdog (status 6)"


def test_the_reconciler_over_systemd_reports_a_unit_that_keeps_dying_as_failing(fake, tmp_path):
    b = backend(tmp_path)
    agent = Reconciler(b, CrashLoop(deaths=3, window_s=60.0))
    events = agent.step([ROLLOUT], now=0.0)
    assert [e.kind for e in events] == ["started"] and fake.calls()[-1] == f"start --no-block {UNIT}"
    fake.state(UNIT, "active")
    assert agent.step([ROLLOUT], now=1.0) == [] and agent.report(1.0)["rollout-0"]["state"] == "running"
    # systemd restarts it three times within the window: failing, and no start of our own meanwhile.
    fake.state(UNIT, "activating", "auto-restart", restarts=3, status=1, result="exit-code")
    kinds = [e.kind for e in agent.step([ROLLOUT], now=2.0)]
    assert kinds.count("died") == 3 and "crash_loop" in kinds and "started" not in kinds
    assert agent.report(2.0)["rollout-0"] == {"role": "rollout", "state": "running", "restarts": 3,
                                              "last_exit": "exit code 1; restarted by systemd", "failing": True}
    # No longer placed: stopped through systemctl, forgotten once inactive.
    assert [e.kind for e in agent.step([], now=3.0)] == ["stopping"]
    assert fake.calls()[-1] == f"stop --no-block {UNIT}"
    fake.state(UNIT, "inactive", "dead")
    assert [e.kind for e in agent.step([], now=4.0)] == ["stopped"] and agent.tracked == {}


def test_a_start_systemctl_refuses_is_a_death_retried_with_backoff(fake, tmp_path):
    (fake.dir / "refuse-start").write_text("")
    agent = Reconciler(backend(tmp_path))
    events = agent.step([ROLLOUT], now=0.0)
    assert [e.kind for e in events] == ["died"] and "start failed" in events[0].exit
    assert "Job failed" in events[0].exit
    assert agent.step([ROLLOUT], now=0.1) == []  # within the backoff: no new attempt
    assert [e.kind for e in agent.step([ROLLOUT], now=0.6)] == ["died"]


# -- the sandbox drop-in (daemons/agent/sandbox_dropin.py) ---------------------------------

ENV_HOST = Placed("h1", "env-host", "env-host-0")
ENV_UNIT = "rlfleet@arith:env-host-0.service"


def sandboxing_backend(tmp_path: Path, roles: set[str]) -> SystemdBackend:
    return SystemdBackend("arith", "h1", {"RLFLEET_JOB": "arith"}, env_dir=tmp_path / "units",
                          sandboxed=lambda role: role in roles, dropin_dir=tmp_path / "run-systemd")


def test_a_sandboxing_role_gets_its_drop_in_before_start_and_loses_it_at_stop(fake, tmp_path):
    b = sandboxing_backend(tmp_path, {"env-host"})
    dropin = tmp_path / "run-systemd" / f"{ENV_UNIT}.d" / "50-sandbox.conf"
    b.start(ENV_HOST)
    assert fake.calls() == ["daemon-reload", f"start --no-block {ENV_UNIT}"]
    assert dropin.read_text() == DROPIN_TEXT and stat.S_IMODE(dropin.stat().st_mode) == 0o644
    settings = [line for line in DROPIN_TEXT.splitlines() if line and not line.startswith("#")]
    assert settings == ["[Service]",
                        "CapabilityBoundingSet=CAP_SYS_ADMIN CAP_SETUID CAP_SETGID CAP_KILL",
                        "AmbientCapabilities=CAP_SYS_ADMIN CAP_SETUID CAP_SETGID CAP_KILL",
                        "RestrictNamespaces=mnt net",
                        "SystemCallFilter=mount setgroups setresuid capset",
                        "ProtectProc=default",
                        "RuntimeDirectory=rlfleet-sandbox", "RuntimeDirectoryMode=0711",
                        "RuntimeDirectoryPreserve=yes"]
    b.start(ENV_HOST)  # unchanged: no second reload
    assert fake.calls()[2:] == [f"start --no-block {ENV_UNIT}"]
    b.stop(ENV_HOST)
    assert fake.calls()[3:] == [f"stop --no-block {ENV_UNIT}", "daemon-reload"]
    assert not dropin.exists() and not dropin.parent.exists()
    b.stop(ENV_HOST)  # nothing left to remove: no reload
    assert fake.calls()[5:] == [f"stop --no-block {ENV_UNIT}"]


def test_other_roles_get_no_drop_in_and_a_stale_one_goes_at_the_next_start(fake, tmp_path):
    roles = {"env-host"}
    b = sandboxing_backend(tmp_path, roles)
    b.start(ROLLOUT)
    assert fake.calls() == [f"start --no-block {UNIT}"]
    assert not (tmp_path / "run-systemd").exists()
    b.start(ENV_HOST)
    roles.clear()  # the spec was reloaded with a task that runs no tool
    b.start(ENV_HOST)
    assert fake.calls()[-2:] == ["daemon-reload", f"start --no-block {ENV_UNIT}"]
    assert not (tmp_path / "run-systemd" / f"{ENV_UNIT}.d").exists()


@pytest.mark.parametrize("example, roles", [("tool_use.toml", {"env-host"}),
                                            ("arithmetic-user-reward.toml", {"reward-host"}),
                                            ("arithmetic.toml", set()),
                                            ("arithmetic-multistage.toml", set())])
def test_the_roles_that_run_the_sandbox_come_from_the_spec(example, roles):
    assert sandboxed_roles(load_spec(EXAMPLES / example)) == roles


def test_a_pipeline_with_a_user_code_stage_runs_the_sandbox():
    data = tomllib.loads((EXAMPLES / "arithmetic.toml").read_text())
    code = tomllib.loads((EXAMPLES / "arithmetic-user-reward.toml").read_text())["reward_host"]["backend"]
    code = {k: v for k, v in code.items() if k not in ("timeout_s", "concurrency")}  # the stage's
    data["reward_host"] = {"backend": {"kind": "pipeline", "stages": [
        {"name": "check", "worker": {"kind": "sim", "median_s": 0.1}},
        {"name": "score", "worker": code}]}}
    assert sandboxed_roles(parse_spec(data, base_dir=EXAMPLES)) == {"reward-host"}
    data["reward_host"]["backend"]["stages"][1]["worker"] = {"kind": "rule_pool"}
    assert sandboxed_roles(parse_spec(data, base_dir=EXAMPLES)) == set()
