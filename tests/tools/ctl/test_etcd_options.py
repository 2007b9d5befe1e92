"""What the `rlfleet` commands that talk to etcd share (tools/ctl/etcd_options.py): every --job
takes only a name a spec could have (common/control/keys.py's rule). Before, `rlfleet status
--job ../x` built keys from it and ended in a ValueError traceback (exit 1)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlfleet.common.job_name import JOB_NAME_RULE, is_job_name
from rlfleet.tools.exit_codes import Exit

DEAD_ETCD = "127.0.0.1:1"  # not reached: the name is refused first (exit 3 would say otherwise)

# Every command with a --job option, with its other required arguments.
COMMANDS = [
    ["daemon", "rollout"],
    ["status"],
    ["accounting", "{tmp}"],
    ["etcd", "snapshot", "{tmp}/snap.json"],
    ["etcd", "restore", "{tmp}/snap.json"],
    ["node", "list"],
    ["node", "cordon", "h1"],
    ["pause"],
    ["resume"],
    ["switchover", "trainer"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_job_option_refuses_a_name_no_spec_could_have(tmp_path, command):
    args = [arg.format(tmp=tmp_path) for arg in command]
    done = subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", *args, "--job", "../x",
                           "--etcd", DEAD_ETCD], capture_output=True, text=True, timeout=60)
    assert done.returncode == Exit.BAD_SPEC, done.stderr
    assert "Traceback" not in done.stderr
    # click's usage error: "Usage: ...", "Try ... for help.", then the one line that says why
    assert done.stderr.splitlines()[-1] == f"Error: Invalid value for '--job': {JOB_NAME_RULE}, got '../x'"


@pytest.mark.parametrize("name", ["../x", "..", "a/b", "x/../y", "", "Demo", "a_b", "a" * 64])
def test_names_a_spec_refuses_are_not_job_names(name):
    assert not is_job_name(name)


@pytest.mark.parametrize("name", ["demo", "arithmetic-vllm", "0", "a" * 63])
def test_job_names(name):
    assert is_job_name(name)
