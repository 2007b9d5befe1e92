"""Run untrusted Python source in a confined child process; never in this one.

    sandbox = Sandbox(SandboxLimits(wall_s=5, cpu_s=2, memory_mib=256))
    result = sandbox.run("print(37*48)")
    result.ok, result.reason, result.stdout        # True, "", "1776\\n"

Pure mechanism, shared by the tool-use task (daemons/tasks/tool_use.py) and anything
else that must run code it does not trust. What confines the child, and how
(docs/operations/sandbox.md):

- its own session and process group (start_new_session), SIGKILLed on the wall-clock
  timeout;
- an unprivileged uid of its own for the run, claimed from a pool with a lock file, so
  that RLIMIT_NPROC counts only this run's processes, the run can write nowhere its
  uid may not, and every process left behind (a fork bomb's children, one that called
  setsid) is found by uid in /proc and killed;
- RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE, RLIMIT_NOFILE, no core files;
- a fresh network namespace (no interface up: no connect, no DNS);
- a mount namespace in which every mount is read-only, except a size-limited tmpfs on
  the run's private temporary directory.

The child (common/sandbox/child.py) sets all of that up itself, as root, in a fresh
single-threaded interpreter, before it drops to the uid, clears every capability set
and runs the code: no preexec_fn runs in this (threaded) process. Running it needs
CAP_SYS_ADMIN (namespaces), CAP_SETUID/CAP_SETGID and CAP_KILL (the sweep): root, or
a systemd unit with the node agent's sandbox drop-in (daemons/agent/sandbox_dropin.py);
without them `run` raises SandboxUnavailable, naming what is missing.

`SandboxResult.reason` names what went wrong, precisely: "" (success), "timeout",
"cpu_limit", "memory_limit", "fork_limit", "network_denied", "write_denied",
"file_size_limit", "tmp_full", "exception" (the code raised; detail has the line),
"exit_code N", "killed by signal NAME".
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import random
import select
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

CHILD = Path(__file__).with_name("child.py")
_SETUP_FAILED = 125  # the child's exit code when it could not confine itself
_REAP_DEADLINE_S = 5.0
# What the child needs to confine itself, by number (linux/capability.h).
REQUIRED_CAPABILITIES = {"CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SYS_ADMIN": 21}
_HOW_TO_GRANT = ("run as root or, under systemd, in a unit with the node agent's drop-in "
                 "50-sandbox.conf (docs/operations/sandbox.md)")

# The failure reasons that are not the code's own doing: a limit hit or an access denied.
CONTAINED = frozenset({"timeout", "cpu_limit", "memory_limit", "fork_limit", "network_denied",
                       "write_denied", "file_size_limit", "tmp_full"})


class SandboxUnavailable(RuntimeError):
    """The child could not confine itself (not root, no namespaces): nothing was run."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 5.0          # then the whole process group (and the uid) is SIGKILLed
    cpu_s: int = 2               # RLIMIT_CPU per process: SIGXCPU, then SIGKILL a second later
    memory_mib: int = 256        # RLIMIT_AS per process (virtual memory: the interpreter uses ~20)
    nproc: int = 16              # processes and threads of the run's uid, the first one included
    file_mib: int = 8            # RLIMIT_FSIZE: the largest file written, stdout/stderr included
    tmp_mib: int = 16            # the private tmpfs
    open_files: int = 64         # RLIMIT_NOFILE
    output_bytes: int = 65536    # of stdout and of stderr kept in the result

    def __post_init__(self) -> None:
        if self.wall_s <= 0 or min(self.cpu_s, self.memory_mib, self.nproc, self.file_mib,
                                   self.tmp_mib, self.open_files, self.output_bytes) < 1:
            raise ValueError(f"sandbox limits must be positive: {self}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    reason: str          # "" when the code ran to the end (module doc lists the others)
    detail: str          # the exception line, the signal, the limit: for a log or a trajectory
    exit_code: int       # the child's; negative: killed by that signal
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float         # of the first process (not of its children)
    leftovers: int       # processes of the run still alive after the first one ended, killed
    pid: int             # the first process (its process group has the same id)
    uid: int             # the run's uid: after `run` returns, no process has it

    @property
    def ok(self) -> bool:
        return not self.reason

    @property
    def contained(self) -> bool:
        """A limit was hit or an access denied: the code misbehaved, the sandbox held."""
        return self.reason in CONTAINED or self.reason.startswith("killed by signal")


def default_state_dir() -> Path:
    """Where the uid pool's lock files are: one directory for every process of the host
    that sandboxes (a unit's RuntimeDirectory=rlfleet-sandbox, or root's /run)."""
    shared = Path("/run/rlfleet-sandbox")
    if os.access(shared, os.W_OK) or os.access("/run", os.W_OK):
        return shared
    return Path(tempfile.gettempdir()) / "rlfleet-sandbox"


def missing_capabilities() -> list[str]:
    """The capabilities the child needs that this process does not hold (effective set):
    the child gets them from it, as root or through a unit's AmbientCapabilities=."""
    with open("/proc/self/status") as f:
        held = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    return [name for name, bit in REQUIRED_CAPABILITIES.items() if not held >> bit & 1]


class Sandbox:
    """Runs source code under `limits`, one child per `run` (thread-safe: concurrent runs
    each claim a uid of their own from uid_base .. uid_base + uids - 1)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), *, uid_base: int = 1_900_000_000,
                 uids: int = 256, state_dir: Path | None = None) -> None:
        self.limits, self.uid_base, self.uids = limits, uid_base, uids
        # Lock files (root only) and the private directories' mount points. 0711: the
        # sandbox uid may pass through to its own directory but not list the others.
        self.state_dir = state_dir or default_state_dir()
        self.state_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o711)
        self._prefixes = _unreachable_prefixes()

    def run(self, source: str) -> SandboxResult:
        if missing := missing_capabilities():
            raise SandboxUnavailable(f"this process (uid {os.getuid()}) lacks {' '.join(missing)}, "
                                     f"which the sandbox needs: {_HOW_TO_GRANT}")
        with self._claim_uid() as uid, self._files() as (tmp, code, out, err, status):
            code.write(source.encode())
            code.flush()
            code.seek(0)
            lim = self.limits
            cfg = {"uid": uid, "gid": uid, "tmp": str(tmp), "status_fd": status.fileno(),
                   "tmp_bytes": lim.tmp_mib << 20, "cpu_s": lim.cpu_s,
                   "memory_bytes": lim.memory_mib << 20, "nproc": lim.nproc,
                   "file_bytes": lim.file_mib << 20, "open_files": lim.open_files,
                   "python_prefixes": self._prefixes}
            started = time.monotonic()
            proc = subprocess.Popen([sys.executable, "-I", "-S", str(CHILD), json.dumps(cfg)],
                                    stdin=code, stdout=out, stderr=err, pass_fds=(status.fileno(),),
                                    start_new_session=True, env={}, cwd=self.state_dir)
            timed_out, exit_code, cpu = _wait(proc, lim.wall_s)
            wall = time.monotonic() - started
            leftovers = _reap(uid, proc.pid)
            stdout, stderr = _read(out, lim.output_bytes), _read(err, lim.output_bytes)
            record = _status_of(status, proc.pid)
        if exit_code == _SETUP_FAILED and record.get("reason") == "setup_failed":
            raise SandboxUnavailable(f"the sandbox could not confine its child: {record['detail']}; "
                                     f"{_HOW_TO_GRANT}")
        reason, detail = self._verdict(timed_out, exit_code, cpu, record)
        return SandboxResult(reason, detail, exit_code, stdout, stderr, round(wall, 4),
                             round(cpu, 4), leftovers, proc.pid, uid)

    def _verdict(self, timed_out: bool, exit_code: int, cpu: float,
                 record: dict[str, str]) -> tuple[str, str]:
        lim = self.limits
        if timed_out:
            return "timeout", f"still running after {lim.wall_s:g} s (wall clock): killed"
        if exit_code < 0:
            sig = signal.Signals(-exit_code)
            # SIGXCPU at the soft limit; SIGKILL at the hard one if the code caught SIGXCPU.
            if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= lim.cpu_s):
                return "cpu_limit", f"{cpu:.2f} s of CPU (limit {lim.cpu_s} s)"
            if sig == signal.SIGXFSZ:
                return "file_size_limit", f"a file over {lim.file_mib} MiB"
            return f"killed by signal {sig.name}", ""
        if "reason" in record:
            return record["reason"], record.get("detail", "")
        if exit_code != 0:
            return f"exit_code {exit_code}", ""
        return "", ""

    @contextlib.contextmanager
    def _claim_uid(self) -> Iterator[int]:
        """A uid no other run (of any process on this host) holds, via a lock file."""
        start = random.randrange(self.uids)
        order = [(start + i) % self.uids for i in range(self.uids)]
        for n, slot in enumerate(order):
            fd = os.open(self.state_dir / f"uid-{self.uid_base + slot}.lock",
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                # All busy: wait for the first one rather than fail the run.
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if n == len(order) - 1 else fcntl.LOCK_NB))
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                uid = self.uid_base + slot
                _reap(uid, None)  # left by a parent that died mid-run
                yield uid
            finally:
                os.close(fd)  # releases the lock
            return

    @contextlib.contextmanager
    def _files(self) -> Iterator[tuple[Path, IO[bytes], IO[bytes], IO[bytes], IO[bytes]]]:
        """The private directory's mount point, and the code, stdout, stderr and status
        files (unlinked, root only: the child gets them as open descriptors)."""
        tmp = Path(tempfile.mkdtemp(prefix="run-", dir=self.state_dir))
        try:
            with contextlib.ExitStack() as stack:
                files = [stack.enter_context(tempfile.TemporaryFile(dir=self.state_dir))
                         for _ in range(4)]
                yield tmp, files[0], files[1], files[2], files[3]
        finally:
            os.rmdir(tmp)  # the tmpfs was in the child's mount namespace: this is empty


def _unreachable_prefixes() -> list[str]:
    """The Python installation's directories that an unprivileged uid cannot reach
    (pyenv under /root, mode 0700): the child bind-mounts them where it can."""
    out = []
    for prefix in dict.fromkeys([os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)]):
        path, reachable = Path(prefix), True
        for d in [path, *path.parents]:
            if not d.stat().st_mode & stat.S_IXOTH:
                reachable = False
        if not reachable:
            out.append(prefix)
    return out


def _wait(proc: subprocess.Popen[bytes], wall_s: float) -> tuple[bool, int, float]:
    """(timed out, exit code, CPU seconds) of the child; the group is SIGKILLed on time out."""
    pidfd = os.pidfd_open(proc.pid)
    try:
        timed_out = not select.select([pidfd], [], [], wall_s)[0]
    finally:
        os.close(pidfd)
    if timed_out:
        _killpg(proc.pid)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    _killpg(proc.pid)  # whatever else is left in its group (the uid sweep catches the rest)
    return timed_out, proc.returncode, usage.ru_utime + usage.ru_stime


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def processes_of(uid: int) -> list[int]:
    """Pids of the live (not zombie) processes whose real or effective uid is `uid`."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                text = f.read()
        except OSError:
            continue  # gone meanwhile
        fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
        uids = fields.get("Uid", "").split()
        if str(uid) in uids[:2] and not fields.get("State", "").startswith(("Z", "X")):
            pids.append(int(name))
    return pids


def _reap(uid: int, first: int | None) -> int:
    """SIGKILL every process of `uid` until none is left; returns how many there were
    (the first process, already waited for, not counted)."""
    killed: set[int] = set()
    deadline = time.monotonic() + _REAP_DEADLINE_S
    while pids := [p for p in processes_of(uid) if p != first]:
        for pid in pids:
            # Through a pidfd, checked after opening it: a pid reused meanwhile by another
            # user's process is never signalled.
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            try:
                if _still_has_uid(pid, uid):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    killed.add(pid)
            except ProcessLookupError:
                pass
            finally:
                os.close(pidfd)
        if time.monotonic() > deadline:
            raise RuntimeError(f"sandbox uid {uid}: processes {pids} survive SIGKILL")
        time.sleep(0.001)  # the kills take effect asynchronously; rescan (bounded above)
    return len(killed)


def _still_has_uid(pid: int, uid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return str(uid) in line.split()[1:3]
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ESRCH):
            raise
    return False


def _read(f: IO[bytes], limit: int) -> str:
    f.seek(0)
    return f.read(limit).decode(errors="replace")


def _status_of(f: IO[bytes], pid: int) -> dict[str, str]:
    """The last status line the first process wrote ({} if none: it died first)."""
    f.seek(0)
    record: dict[str, str] = {}
    for line in f.read(1 << 20).decode(errors="replace").splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue  # the code wrote to the status fd itself
        if isinstance(r, dict) and r.get("pid") == pid:
            record = {k: str(v) for k, v in r.items()}
    return record
