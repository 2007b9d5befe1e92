"""The process backend's per-daemon CPU meter counts a daemon's descendants (reward workers)
with real processes, while scanning /proc for them only now and then."""

from __future__ import annotations

import subprocess
import sys

import psutil

from rlfleet.daemons.agent import process
from rlfleet.daemons.agent.process import TreeCpu, tree_cpu_s
from tests.integration.helpers import wait_for

# A parent that starts one child burning ~0.3 s of CPU, then waiting for a line on its stdin
# to exit; the parent prints the child's pid, and "reaped" once the child is gone.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import sys, time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.3: pass\\nsys.stdin.readline()"],
    stdin=subprocess.PIPE)
print(child.pid, flush=True)
sys.stdin.readline()
child.stdin.close()
child.wait()
print("reaped", flush=True)
sys.stdin.read()  # until the test kills it
"""


def _cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def test_descendants_count_and_are_looked_up_again_after_the_rescan_interval(monkeypatch):
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        child = int(parent.stdout.readline())
        scans = []
        children = psutil.Process.children
        monkeypatch.setattr(psutil.Process, "children", lambda self, **kw: scans.append(1) or children(self, **kw))
        meter = TreeCpu(parent.pid)
        wait_for("the child to burn its 0.3 s of CPU", lambda: _cpu(child) >= 0.3, timeout_s=20)
        assert meter.read() >= _cpu(child) + _cpu(parent.pid) - 0.01
        sampled = meter.read()
        assert len(meter._procs) == 2 and len(scans) == 1  # one /proc scan for all those samples
        assert abs(sampled - tree_cpu_s(parent.pid)) < 0.05

        # Between rescans only the known processes are read; a rescan finds the tree again.
        monkeypatch.setattr(process, "TREE_RESCAN_S", 0.0)
        assert meter.read() >= 0.3 and len(meter._procs) == 2
        parent.stdin.write("end the child\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "reaped"
        meter.read()  # notices the child ended
        meter.read()
        assert [p.pid for p in meter._procs] == [parent.pid]
    finally:
        parent.kill()
        parent.wait()
