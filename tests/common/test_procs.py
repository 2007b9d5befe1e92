"""with_parent_death: a child started through it dies when the process that started it is
killed -9, keeps its own pid (setpriv execs), and is started without a preexec_fn."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil

from rlfleet.common.procs import with_parent_death
from tests.integration.helpers import wait_for

# A parent that starts `sleep` through with_parent_death, prints the sleeper's pid, then
# waits for a signal (the test's kill -9).
PARENT = """
import signal, subprocess
from rlfleet.common.procs import with_parent_death
child = subprocess.Popen(with_parent_death(["sleep", "600"], signal.SIGKILL), start_new_session=True)
print(child.pid, flush=True)
signal.pause()
"""


def test_the_child_dies_with_its_parent_killed_9():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        wait_for("the child to exec sleep (same pid as setpriv)", lambda: child.name() == "sleep", 10)
        parent.kill()
        parent.wait()
        wait_for("the child to get SIGKILL from the kernel once its parent died",
                 lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, 10)
    finally:
        parent.kill()
        parent.stdout.close()


def test_it_names_the_signal_and_keeps_the_command():
    argv = with_parent_death(["etcd", "--name", "m0"], signal.SIGTERM)
    assert argv[0].endswith("setpriv") and argv[1:4] == ["--pdeathsig", "TERM", "--"]
    assert argv[4:] == ["etcd", "--name", "m0"]
