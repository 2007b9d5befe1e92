"""common/sandbox.py on this machine: real children, each hostile program contained and
named precisely, nothing left running, nothing written outside the private directory."""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

import pytest

from rlfleet.common.sandbox import Sandbox, SandboxLimits, SandboxUnavailable, processes_of

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root "
                                "(namespaces, setuid): see docs/sandbox.md")

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=1, memory_mib=128, nproc=8, file_mib=1, tmp_mib=1)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(LIMITS)


def group_members(pgid: int) -> list[int]:
    """Live processes whose process group is `pgid` (field 5 of /proc/PID/stat)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()  # after "(comm)", which may hold blanks
            if fields[0] not in "ZX" and int(fields[2]) == pgid:
                out.append(int(name))
    return out


def assert_nothing_left(result) -> None:
    assert processes_of(result.uid) == []
    assert group_members(result.pid) == []


def test_plain_code_runs_and_its_output_comes_back(sandbox):
    r = sandbox.run("print(37*48)")
    assert (r.ok, r.reason, r.exit_code, r.stdout) == (True, "", 0, "1776\n")
    assert r.uid != 0 and r.leftovers == 0
    assert_nothing_left(r)


def test_the_code_runs_unprivileged_in_its_private_directory(sandbox):
    r = sandbox.run("import os\nopen('note', 'w').write('kept')\n"
                    "print(os.getuid(), os.getgid(), os.getgroups(), os.getcwd() == os.environ['TMPDIR'],"
                    " open('note').read())")
    uid, gid, groups, in_tmp, note = r.stdout.split()
    assert r.ok, r
    assert int(uid) == r.uid == int(gid) and groups == "[]" and in_tmp == "True" and note == "kept"


HOSTILE = {
    # name: (source, reason)
    "infinite loop": ("while True: pass", "cpu_limit"),
    "sleeps past the wall clock": ("import time\ntime.sleep(3600)", "timeout"),
    "fork bomb": ("import os\nwhile True: os.fork()", "fork_limit"),
    "memory hog": ("hog = bytearray(1 << 30)", "memory_limit"),
    "socket open": ("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)",
                    "network_denied"),
    "loopback socket": ("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=2)",
                        "network_denied"),
    "name lookup": ("import socket\nsocket.getaddrinfo('example.com', 80)", "network_denied"),
    "big file in the private directory": ("open('big', 'wb').write(b'x' * (2 << 20))",
                                          "file_size_limit"),
    "raises": ("1/0", "exception"),
    "exits 3": ("import sys\nsys.exit(3)", "exit_code 3"),
    "crashes": ("import ctypes\nctypes.string_at(0)", "killed by signal SIGSEGV"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_code_is_contained_and_named(sandbox, name):
    source, reason = HOSTILE[name]
    started = time.monotonic()
    r = sandbox.run(source)
    assert r.reason == reason, r
    assert not r.ok
    assert time.monotonic() - started < LIMITS.wall_s + 2.0
    assert_nothing_left(r)
    # The sandbox (and this process) go on as before.
    assert sandbox.run("print(6*7)").stdout == "42\n"


@pytest.mark.parametrize("where", ["/tmp", "/dev/shm", "/var/tmp"])
def test_writes_outside_the_private_directory_are_denied(sandbox, where):
    """World-writable directories: the uid alone would not stop these, the read-only
    mount namespace does."""
    target = Path(where) / f"rlfleet-sandbox-escape-{uuid.uuid4().hex}"
    r = sandbox.run(f"open({str(target)!r}, 'w').write('escaped')")
    assert r.reason == "write_denied", r
    assert str(target) in r.detail
    assert not target.exists()
    assert_nothing_left(r)


def test_a_root_owned_directory_is_not_writable_either(sandbox):
    target = Path("/root") / f"rlfleet-sandbox-escape-{uuid.uuid4().hex}"
    r = sandbox.run(f"import os\nos.mkdir({str(target)!r})")
    assert r.reason == "write_denied", r
    assert not target.exists()


def test_processes_that_leave_the_group_are_killed_too(sandbox):
    """setsid() takes a child out of the process group killpg reaches; the uid sweep
    still finds it."""
    # The parent waits until each child has left the group (a byte on a pipe), else a
    # child still in it when the parent exits is killed by the group kill, not the sweep.
    r = sandbox.run("import os, time\nr, w = os.pipe()\nfor _ in range(3):\n"
                    "    if os.fork() == 0:\n        os.setsid()\n        os.write(w, b'x')\n"
                    "        time.sleep(3600)\n"
                    "got = 0\nwhile got < 3:\n    got += len(os.read(r, 3 - got))\n")
    assert r.ok and r.leftovers == 3, r
    assert_nothing_left(r)


def test_a_sigxcpu_handler_does_not_buy_more_cpu(sandbox):
    r = sandbox.run("import signal\nsignal.signal(signal.SIGXCPU, lambda *a: None)\nwhile True: pass")
    assert r.reason == "cpu_limit", r
    assert_nothing_left(r)


def test_concurrent_runs_get_uids_of_their_own(sandbox):
    """Two fork bombs at once: each has the whole nproc budget, both are cleaned up."""
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(
        sandbox.run("import os\nwhile True: os.fork()"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.reason for r in results] == ["fork_limit"] * 2
    assert results[0].uid != results[1].uid
    for r in results:
        assert_nothing_left(r)


def test_without_the_privileges_nothing_runs(tmp_path):
    """A child that cannot confine itself reports it; the code is never run unconfined."""
    marker = tmp_path / "ran"
    sandbox = Sandbox(LIMITS, uid_base=2_000_000_000)
    sandbox._prefixes = ["/nonexistent-python-prefix"]  # the bind mount fails in the child
    with pytest.raises(SandboxUnavailable, match="could not confine"):
        sandbox.run(f"open({str(marker)!r}, 'w')")
    assert not marker.exists()


def test_limits_must_be_positive():
    with pytest.raises(ValueError):
        SandboxLimits(cpu_s=0)
