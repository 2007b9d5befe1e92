"""common/sandbox/parent.py on this machine: real children, each hostile program contained and
named precisely, nothing left running, nothing written outside the private directory."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

from rlfleet.common.sandbox import parent as sandbox_module
from rlfleet.common.sandbox.parent import Sandbox, SandboxLimits, SandboxUnavailable, processes_of

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root "
                                "(namespaces, setuid): see docs/operations/sandbox.md")

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
    r = sandbox.run(source)
    assert r.reason == reason, r  # the limit that ended it ("timeout": the wall clock's)
    assert not r.ok
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


def test_a_sigxcpu_handler_does_not_buy_more_cpu():
    # The hard limit is cpu_s + 1 = 2 s of CPU: at nice 19 on a busy machine that takes
    # longer than LIMITS' 3 s of wall clock, and the run would end as a timeout instead.
    sandbox = Sandbox(dataclasses.replace(LIMITS, wall_s=30.0))
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


# -- capabilities (the child clears them all: sandbox_child.clear_capabilities) ---------------

CAPS = "sys_admin,setuid,setgid,kill"  # the node agent's drop-in grants these (50-sandbox.conf)
UNIT_UID = 1_899_999_000  # the parent's uid in the systemd-like runs: not root, not in the pool
SHOW_CAPS = "print(open('/proc/self/status').read())"
HOSTILE_PRIVILEGED = {
    "setuid(0)": "import os\nos.setuid(0)",
    "mount": ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
              "if libc.mount(b'none', b'/tmp', b'tmpfs', 0, None):\n"
              "    raise OSError(ctypes.get_errno(), 'mount: ' + os.strerror(ctypes.get_errno()))"),
}
# Runs the sandbox as a unit's daemon would: the system python (an unprivileged uid cannot
# reach this venv's interpreter under /root), sandbox.py loaded by path (stdlib only).
HARNESS = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
sb = sys.modules["sandbox"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sb)
box = sb.Sandbox(sb.SandboxLimits(wall_s=3.0, cpu_s=1, memory_mib=128, nproc=8, file_mib=1,
                                  tmp_mib=1), state_dir=sb.Path(sys.argv[2]))
out = {"parent": open("/proc/self/status").read()}
for name, source in json.loads(sys.stdin.read()).items():
    try:
        r = box.run(source)
        out[name] = [r.reason, r.detail, r.stdout, len(sb.processes_of(r.uid))]
    except sb.SandboxUnavailable as exc:
        out[name] = ["unavailable", str(exc), "", 0]
print(json.dumps(out))
"""


def cap_sets(status: str) -> dict[str, int]:
    return {k: int(v, 16) for k, _, v in (line.partition(":\t") for line in status.splitlines())
            if k.startswith("Cap")}


def test_the_code_holds_no_capability_and_cannot_take_root_back(sandbox):
    r = sandbox.run(SHOW_CAPS)
    assert r.ok, r
    assert cap_sets(r.stdout) == {"CapInh": 0, "CapPrm": 0, "CapEff": 0, "CapBnd": 0, "CapAmb": 0}
    for name, source in HOSTILE_PRIVILEGED.items():
        r = sandbox.run(source)
        assert r.reason == "exception" and "Operation not permitted" in r.detail, (name, r)
        assert_nothing_left(r)


def run_as_unit(tmp_path: Path, sources: dict[str, str], caps: str | None) -> dict:
    """The sources run by a parent of uid UNIT_UID with `caps` as its ambient (and bounding)
    capabilities: what systemd makes of User=rlfleet plus the drop-in's lines."""
    if not Path("/usr/bin/setpriv").exists() or not Path("/usr/bin/python3").exists():
        pytest.skip("needs setpriv (util-linux) and /usr/bin/python3")
    state = Path(tempfile.mkdtemp(prefix="rlfleet-sandbox-unit-", dir="/tmp"))
    # The unit's uid reads the sandbox's two files from a copy: the checkout may sit in a
    # directory only root can enter (a clone into `mktemp -d` is mode 0700).
    code = Path(tempfile.mkdtemp(prefix="rlfleet-sandbox-code-", dir="/tmp"))
    try:
        os.chmod(state, 0o755)
        os.chown(state, UNIT_UID, UNIT_UID)
        os.chmod(code, 0o755)
        module = Path(sandbox_module.__file__)
        for name in (module.name, "child.py"):
            shutil.copy(module.with_name(name), code / name)
            os.chmod(code / name, 0o644)
        raised = ",+" + caps.replace(",", ",+") if caps else ""
        grant = [f"--inh-caps=-all{raised}", f"--bounding-set=-all{raised}",
                 *([f"--ambient-caps={raised[1:]}"] if caps else [])]
        done = subprocess.run(["/usr/bin/setpriv", f"--reuid={UNIT_UID}", f"--regid={UNIT_UID}",
                               "--clear-groups", *grant, "/usr/bin/python3", "-I", "-c", HARNESS,
                               str(code / module.name), str(state)],
                              input=json.dumps(sources), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)
    finally:
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(code, ignore_errors=True)


def test_under_a_unit_with_ambient_capabilities_the_child_drops_them_all(tmp_path):
    """setuid from a non-root uid keeps every capability: without the clearing, the code
    would hold CAP_SYS_ADMIN, and a fork bomb would ignore RLIMIT_NPROC."""
    sources = {"caps": SHOW_CAPS, **HOSTILE_PRIVILEGED, "fork bomb": HOSTILE["fork bomb"][0],
               "write outside": "open('/tmp/rlfleet-sandbox-escape', 'w')"}
    out = run_as_unit(tmp_path, sources, CAPS)
    parent = cap_sets(out.pop("parent"))
    assert parent["CapAmb"] == parent["CapEff"] == (1 << 5 | 1 << 6 | 1 << 7 | 1 << 21)  # the setup holds
    reason, _, stdout, left = out.pop("caps")
    assert reason == "" and left == 0
    child = cap_sets(stdout)
    assert (child["CapEff"], child["CapPrm"], child["CapInh"], child["CapAmb"]) == (0, 0, 0, 0)
    for name in HOSTILE_PRIVILEGED:
        assert out[name][0] == "exception" and "Operation not permitted" in out[name][1], out[name]
    assert out["fork bomb"][0] == "fork_limit" and out["fork bomb"][3] == 0
    assert out["write outside"][0] == "write_denied"


def test_under_a_unit_without_the_drop_in_the_sandbox_says_what_is_missing(tmp_path):
    out = run_as_unit(tmp_path, {"trivial": "print(1)"}, None)
    reason, detail, _, _ = out["trivial"]
    assert reason == "unavailable"
    assert "lacks CAP_KILL CAP_SETGID CAP_SETUID CAP_SYS_ADMIN" in detail and "50-sandbox.conf" in detail
