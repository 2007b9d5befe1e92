"""The unit files in systemd/: `systemd-analyze verify` is clean (nothing on stderr:
it exits 0 on some bad keys and only warns), and they say what the deployment
contract says (paths, environment files, commands) so the agent and Ansible fit."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from rlfleet.tools.bench.unit_security import SYSTEM_UNITS, stand_in_root

REPO = Path(__file__).resolve().parents[2]
UNITS = sorted((REPO / "systemd").glob("*.service"))

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None or not SYSTEM_UNITS.is_dir(),
                                   reason="systemd-analyze is not installed (Debian package systemd)")


def verify(root: Path, unit_file: Path) -> subprocess.CompletedProcess:
    """verify the unit file under a root with stand-ins for the commands it runs
    (nothing is installed for it); a template is verified as its instance `@i`."""
    (target,) = stand_in_root(root, [unit_file])
    return subprocess.run(["systemd-analyze", "verify", f"--root={root}", "--man=no", "--generators=no",
                           str(target)], capture_output=True, text=True, timeout=120)


def test_every_unit_of_the_contract_is_there():
    assert [u.name for u in UNITS] == ["rlfleet-agent@.service", "rlfleet-etcd.service", "rlfleet@.service"]


@needs_analyze
@pytest.mark.parametrize("unit_file", UNITS, ids=lambda u: u.name)
def test_systemd_analyze_verify_is_clean(tmp_path, unit_file):
    result = verify(tmp_path, unit_file)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr


@needs_analyze
def test_verify_would_catch_a_bad_key(tmp_path):
    """The check above can fail: a misspelt key exits 0 but warns on stderr."""
    bad = tmp_path / "rlfleet-etcd.service"
    bad.write_text((REPO / "systemd" / "rlfleet-etcd.service").read_text()
                   .replace("NoNewPrivileges=yes", "NoNewPrivilege=yes"))
    result = verify(tmp_path / "root", bad)
    assert "NoNewPrivilege" in result.stderr


def unit_lines(name: str) -> set[str]:
    return {line.strip() for line in (REPO / "systemd" / name).read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def test_the_daemon_unit_matches_the_contract():
    lines = unit_lines("rlfleet@.service")
    assert {"Type=notify", "NotifyAccess=main", "Restart=on-failure", "User=rlfleet",
            "EnvironmentFile=/run/rlfleet/units/%i.env",
            "ExecStart=/opt/rlfleet/venv/bin/rlfleet daemon ${RLFLEET_ROLE} --job ${RLFLEET_JOB} "
            "--id ${RLFLEET_MEMBER_ID}",
            "ExecReload=/bin/kill -HUP $MAINPID", "ProtectSystem=strict", "NoNewPrivileges=yes",
            "RemoveIPC=no"} <= lines
    # The relay's /dev/shm files must stay visible to the rollouts' units.
    assert not {line for line in lines if line.startswith(("PrivateDevices=", "PrivateIPC="))}
    assert not {line for line in lines if line.startswith("MemoryDenyWriteExecute=")}  # torch JITs


def test_the_agent_and_etcd_units_match_the_contract():
    agent = unit_lines("rlfleet-agent@.service")
    assert {"Type=notify", "User=root", "EnvironmentFile=/etc/rlfleet/jobs/%i.env",
            "ExecStart=/opt/rlfleet/venv/bin/rlfleet daemon agent --job %i --backend systemd",
            "RuntimeDirectory=rlfleet/units", "RuntimeDirectoryPreserve=yes"} <= agent
    etcd = unit_lines("rlfleet-etcd.service")
    assert {"User=etcd", "EnvironmentFile=/etc/rlfleet/etcd.env", "ExecStart=/usr/bin/etcd"} <= etcd


def test_a_stop_outlasts_the_longest_drain():
    from rlfleet.daemons.trainer.daemon import DRAIN_TIMEOUT_S  # the trainer: finish a step, checkpoint
    (stop,) = [line for line in unit_lines("rlfleet@.service") if line.startswith("TimeoutStopSec=")]
    assert float(stop.removeprefix("TimeoutStopSec=").removesuffix("s")) > DRAIN_TIMEOUT_S
