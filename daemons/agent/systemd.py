"""Placed daemons as systemd units (the systemd backend, on cluster hosts).

A daemon is the instance `rlfleet@<job>:<id>.service` of the template unit in
systemd/ (ExecStart runs `rlfleet daemon ${RLFLEET_ROLE} --job ${RLFLEET_JOB}
--id ${RLFLEET_MEMBER_ID}`). Before starting it the agent writes its
environment file `/run/rlfleet/units/<job>:<id>.env`: the agent's own job
variables (RLFLEET_*, from the job's env file), RLFLEET_ROLE,
RLFLEET_MEMBER_ID, and CUDA_VISIBLE_DEVICES where the job assigns GPUs. systemd
restarts a unit that dies (Restart=on-failure); the agent reads `NRestarts` to
count those deaths, and starts again (after `reset-failed`, with its own
backoff) a unit systemd gave up on.

`start` and `stop` pass --no-block: a trainer may take a minute to be ready
(Type=notify) or to drain, and the agent's loop must go on refreshing its lease.

A unit whose role runs the sandbox (`sandboxed(role)`) gets the drop-in of
sandbox_dropin.py before its start, and loses it at its stop; a daemon-reload follows
only a change, so starting the other units costs no reload.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

from rlfleet.common.control.placement import Placed
from rlfleet.daemons.agent.backend import Observed, role_of
from rlfleet.daemons.agent.sandbox_dropin import DROPIN_DIR, SandboxDropins

UNIT_ENV_DIR = Path("/run") / "rlfleet" / "units"  # (a path, not an etcd key)
SHOW_PROPERTIES = ("ActiveState", "SubState", "NRestarts", "ExecMainStatus", "Result")
# Running, on its way up, reloading, or draining: not a state to start it from.
ACTIVE_STATES = ("active", "activating", "reloading", "deactivating", "refreshing")
_SAFE_VALUE = re.compile(r"^[A-Za-z0-9_./:,=@%+-]*$")


def unit_name(job: str, member_id: str) -> str:
    return f"rlfleet@{job}:{member_id}.service"


def env_file_text(env: dict[str, str]) -> str:
    """KEY=VALUE lines systemd's EnvironmentFile= reads back exactly: a value with other
    characters than the safe ones is double-quoted, backslash and quote escaped."""
    lines = ["# written by the rlfleet agent before it starts the unit; rewritten at every start"]
    for key, value in sorted(env.items()):
        if "\n" in value or "\r" in value:
            raise ValueError(f"${key}: a newline cannot go into a systemd environment file")
        if not _SAFE_VALUE.match(value):
            value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        lines.append(f"{key}={value}")
    return "\n".join(lines) + "\n"


def parse_show(text: str) -> dict[str, str]:
    """`systemctl show -p A,B unit` prints A=...\\nB=...; order is systemd's, not ours."""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def death_phrase(result: str, status: str) -> str:
    """systemd's Result= and ExecMainStatus= as the process backend's phrases."""
    if result in ("exit-code", "success"):
        return f"exit code {status or 0}"
    if result in ("signal", "core-dump"):
        return f"signal {status}" + (", core dumped" if result == "core-dump" else "")
    return f"{result} (status {status or '?'})"  # watchdog, timeout, start-limit-hit, ...


class SystemdBackend:
    name = "systemd"

    def __init__(self, job: str, host: str, env: dict[str, str], env_dir: Path = UNIT_ENV_DIR,
                 run: Callable[..., subprocess.CompletedProcess] = subprocess.run, *,
                 sandboxed: Callable[[str], bool] = lambda role: False,
                 dropin_dir: Path = DROPIN_DIR) -> None:
        self.job, self.host, self.env, self.env_dir, self._run = job, host, env, env_dir, run
        self.sandboxed = sandboxed  # role -> does it run the sandbox (read at each start)
        self.dropins = SandboxDropins(dropin_dir)
        self._seen: dict[str, tuple[str, int]] = {}  # member id -> (ActiveState, NRestarts) last seen

    def systemctl(self, *args: str, check: bool = True) -> str:
        try:
            done = self._run(["systemctl", *args], capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"systemctl {' '.join(args)}: no answer in 30 s") from None
        if check and done.returncode != 0:
            raise RuntimeError(f"systemctl {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def unit(self, member_id: str) -> str:
        return unit_name(self.job, member_id)

    def env_path(self, member_id: str) -> Path:
        return self.env_dir / f"{self.job}:{member_id}.env"

    def write_env(self, placed: Placed) -> Path:
        env = {**self.env, "RLFLEET_ROLE": placed.role, "RLFLEET_MEMBER_ID": placed.member_id,
               **placed.environment()}  # its GPUs (CUDA_VISIBLE_DEVICES), where the job assigns them
        path = self.env_path(placed.member_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # credential paths: root only
        with os.fdopen(fd, "w") as f:
            f.write(env_file_text(env))
        os.replace(tmp, path)  # systemd never reads half a file
        return path

    # -- the backend interface ----------------------------------------------------
    def start(self, placed: Placed) -> str:
        self.write_env(placed)
        unit = self.unit(placed.member_id)
        # Also removes one a spec no longer asks for (reloaded since the last start).
        if self.dropins.apply(unit, self.sandboxed(placed.role)):
            self.systemctl("daemon-reload")
        if self._seen.get(placed.member_id, ("",))[0] == "failed":
            self.systemctl("reset-failed", unit, check=False)  # else the start limit may refuse it
        self.systemctl("start", "--no-block", unit)
        return unit

    def observe(self, placed: Placed) -> Observed:
        shown = parse_show(self.systemctl("show", "-p", ",".join(SHOW_PROPERTIES), self.unit(placed.member_id)))
        state = shown.get("ActiveState", "inactive")
        try:
            restarts = int(shown.get("NRestarts", "0") or 0)
        except ValueError:
            restarts = 0
        phrase = death_phrase(shown.get("Result", ""), shown.get("ExecMainStatus", ""))
        last_state, last_restarts = self._seen.get(placed.member_id, (state, restarts))
        self._seen[placed.member_id] = (state, restarts)
        # Each restart systemd made since the last look is one death (NRestarts resets only
        # when the unit is started anew); a unit that left an active state died too.
        deaths = [f"{phrase}; restarted by systemd"] * max(0, restarts - last_restarts)
        active = state in ACTIVE_STATES
        if not active and last_state in ACTIVE_STATES:
            deaths.append(phrase)
        return Observed(active, tuple(deaths))

    def stop(self, placed: Placed) -> None:
        unit = self.unit(placed.member_id)
        self.systemctl("stop", "--no-block", unit)
        # The running process keeps what it was started with; a restart could not use it.
        if self.dropins.apply(unit, False):
            self.systemctl("daemon-reload")

    def existing(self, job_hosts: frozenset[str]) -> list[Placed]:
        out = self.systemctl("list-units", "--all", "--plain", "--no-legend", "--no-pager",
                             unit_name(self.job, "*"), check=False)
        found = []
        prefix, suffix = f"rlfleet@{self.job}:", ".service"
        for line in out.splitlines():
            fields = line.split()
            if len(fields) < 3 or not fields[0].startswith(prefix) or not fields[0].endswith(suffix):
                continue
            member_id = fields[0][len(prefix):-len(suffix)]
            if fields[2] in ACTIVE_STATES and role_of(member_id):
                found.append(Placed(self.host, role_of(member_id), member_id))
        return found

    def release(self, grace_s: float, note: Callable[[str], None]) -> str:
        return "units keep running under systemd"  # an agent restart must not bounce the job
