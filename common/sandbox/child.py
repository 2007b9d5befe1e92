"""The sandboxed child of common/sandbox/parent.py: confine this process, then run the code.

Run as ``python -I -S child.py CONFIG_JSON`` by `Sandbox.run`, as root, in a
session (process group) of its own, with the code to run on stdin and a status file
on an inherited fd. Standard library only, and nothing else of rlfleet is imported: the code runs
in this interpreter once it is confined, so the less it has loaded the better.

In order, before any of the code runs:

1. read the code from stdin (stdin becomes /dev/null);
2. a new network namespace (only a loopback, down: every connect fails) and a new
   mount namespace, in which every mount is remounted read-only;
3. a size-limited tmpfs, mode 0700, owned by the sandbox uid, on the private temporary
   directory: the one writable place. The Python installation is bind-mounted
   read-only inside it when it lies under a directory the sandbox uid cannot enter
   (pyenv in /root), and sys.path is pointed there;
4. rlimits (CPU seconds, address space, processes of the uid, file size, no core
   files), the capability bounding set emptied (where CAP_SETPCAP allows: as root),
   then setgroups([]), setgid, setuid to an unprivileged uid of its own (so
   RLIMIT_NPROC counts only this run's processes);
5. every capability set cleared (ambient, then effective, permitted, inheritable) and
   checked in /proc/self/status: under a systemd unit the parent is an unprivileged
   user with ambient capabilities, and setuid from a non-root uid keeps them all (a
   fork bomb with CAP_SYS_ADMIN ignores RLIMIT_NPROC); any left refuses the run;
6. no_new_privs; the working directory, HOME and TMPDIR become the private directory.

Then the code runs as ``__main__``. An uncaught exception is classified (see
`classify`) and written, as one JSON line with this pid, to the status file (an fd the config names); the
parent ignores lines from other pids (a forked child runs this same epilogue).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import sys
import traceback

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096
MS_REC, MS_PRIVATE = 16384, 1 << 18
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 24, 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
CAP_SETS = ("CapInh", "CapPrm", "CapEff", "CapAmb")  # /proc/self/status; CapBnd apart

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]

# Errors a socket call gets in a network namespace with no usable interface.
_NETWORK_ERRNOS = {errno.ENETUNREACH, errno.ENETDOWN, errno.EHOSTUNREACH,
                   errno.EADDRNOTAVAIL, errno.ECONNREFUSED}
_WRITE_EVENTS = {"os.mkdir", "os.remove", "os.rmdir", "os.rename", "os.symlink", "os.link",
                 "os.chmod", "os.chown", "os.truncate", "os.utime", "shutil.copyfile",
                 "shutil.move", "shutil.rmtree"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):  # two of them: capabilities 0-31 and 32-63
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _prctl(option: int, arg: int = 0) -> int:
    # unsigned long arguments, the unused ones zero: PR_CAP_AMBIENT refuses garbage there.
    return _libc.prctl(option, *(ctypes.c_ulong(a) for a in (arg, 0, 0, 0)))


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
           f"mount {target}")


def _mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            # Field 5 is the mount point, with blanks and such octal-escaped (\040).
            raw = line.split()[4]
            points.append(raw.encode().decode("unicode_escape"))
    return points


def _relocate(prefix: str, dest: str) -> None:
    """Import from `dest` what was found under `prefix`: sys.path, and the search paths
    of packages already imported (encodings finds its codecs through its __path__)."""
    def moved(p: str) -> str:
        return dest + p[len(prefix):] if p == prefix or p.startswith(prefix + "/") else p

    sys.path[:] = [moved(p) for p in sys.path]
    for module in list(sys.modules.values()):
        path = getattr(module, "__path__", None)
        if isinstance(path, list):
            path[:] = [moved(p) for p in path]
    sys.path_importer_cache.clear()


def confine(cfg: dict) -> None:
    """Steps 2-6 of the module doc. Any failure here is a setup failure (exit 125)."""
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET), "unshare")
    # Nothing mounted or unmounted in here may propagate back to the host.
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    # Parents first, so a remount never hides one done before it.
    for point in sorted(set(_mount_points()), key=lambda p: p.count("/")):
        try:
            # MS_BIND: change this mount's flags only, never the filesystem's (the host's).
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        except OSError as exc:
            # Gone meanwhile, or a pseudo filesystem that refuses: nothing to write to there.
            if exc.errno not in (errno.ENOENT, errno.EINVAL, errno.EACCES):
                raise
    tmp, uid, gid = cfg["tmp"], cfg["uid"], cfg["gid"]
    _mount("tmpfs", tmp, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={cfg['tmp_bytes']},nr_inodes=4096,mode=0700,uid={uid},gid={gid}")
    for i, prefix in enumerate(cfg["python_prefixes"]):
        dest = os.path.join(tmp, f".python{i}")
        os.mkdir(dest)
        _mount(prefix, dest, None, MS_BIND | MS_REC)
        _mount(None, dest, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        _relocate(prefix, dest)
    limits = {resource.RLIMIT_CPU: (cfg["cpu_s"], cfg["cpu_s"] + 1),
              resource.RLIMIT_AS: (cfg["memory_bytes"],) * 2,
              resource.RLIMIT_NPROC: (cfg["nproc"],) * 2,
              resource.RLIMIT_FSIZE: (cfg["file_bytes"],) * 2,
              resource.RLIMIT_CORE: (0, 0),
              resource.RLIMIT_NOFILE: (cfg["open_files"],) * 2}
    for which, value in limits.items():
        resource.setrlimit(which, value)
    _drop_bounding_set()  # before setuid: root loses CAP_SETPCAP with it
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    clear_capabilities()
    _check(_prctl(PR_SET_NO_NEW_PRIVS, 1), "prctl(NO_NEW_PRIVS)")
    os.chdir(tmp)
    os.umask(0o077)
    os.environ.clear()
    os.environ.update({"HOME": tmp, "TMPDIR": tmp, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})


def _drop_bounding_set() -> None:
    """Empty the bounding set as far as this process may: it needs CAP_SETPCAP, which root
    has and a unit granted only the sandbox's capabilities has not (its bounding set is
    those four, and once they are cleared below no_new_privs keeps exec from adding any)."""
    cap = 0
    while _prctl(PR_CAPBSET_DROP, cap) == 0:
        cap += 1
    err = ctypes.get_errno()
    if err not in (errno.EINVAL, errno.EPERM):  # EINVAL: past the last capability
        raise OSError(err, f"prctl(CAPBSET_DROP {cap}): {os.strerror(err)}")


def capability_sets() -> dict[str, int]:
    """This process's capability sets as /proc/self/status shows them."""
    with open("/proc/self/status") as f:
        return {k: int(v, 16) for k, _, v in (line.partition(":\t") for line in f)
                if k in CAP_SETS}


def clear_capabilities() -> None:
    """Clear the ambient, effective, permitted and inheritable sets, then check that the
    kernel shows none left: the untrusted code must hold no capability at all."""
    _check(_prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL), "prctl(CAP_AMBIENT_CLEAR_ALL)")
    header, data = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")
    sets = capability_sets()
    held = {k: f"{v:016x}" for k, v in sets.items() if v}
    if held or len(sets) != len(CAP_SETS):  # a set the kernel does not show is not known empty
        raise PermissionError(f"capabilities left after dropping them, refusing to run: {held}")


class Attempts:
    """What the code tried, from audit hooks (the kernel did the refusing; this only
    names what was refused)."""

    def __init__(self) -> None:
        self.forked = self.networked = False
        self.written: set[str] = set()

    def hook(self, event: str, args: tuple) -> None:
        if event in ("os.fork", "os.forkpty", "os.posix_spawn", "subprocess.Popen"):
            self.forked = True
        elif event.startswith("socket.") and event != "socket.__new__":
            self.networked = True
        elif event == "open" and len(args) >= 3 and isinstance(args[0], str):
            mode, flags = args[1], args[2]
            if (isinstance(mode, str) and set(mode) & set("wax+")) or \
                    (isinstance(flags, int) and flags & _WRITE_FLAGS):
                self.written.add(args[0])
        elif event in _WRITE_EVENTS and args and isinstance(args[0], (str, bytes)):
            self.written.add(os.fsdecode(args[0]))


def classify(exc: BaseException, seen: Attempts) -> str:
    """The failure reason of an uncaught exception: a limit or a denial when it is one."""
    if isinstance(exc, MemoryError):
        return "memory_limit"
    if isinstance(exc, OSError):
        if exc.errno == errno.EAGAIN and seen.forked:
            return "fork_limit"
        if exc.__class__.__module__ == "socket" or (exc.errno in _NETWORK_ERRNOS and seen.networked):
            return "network_denied"  # socket.gaierror: no resolver reachable either
        if exc.errno == errno.EROFS or (exc.errno in (errno.EACCES, errno.EPERM)
                                        and exc.filename is not None
                                        and os.fsdecode(exc.filename) in seen.written):
            return "write_denied"
        if exc.errno == errno.EFBIG:
            return "file_size_limit"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return "tmp_full"
    return "exception"


_status_fd = -1  # from the config: the parent's status file


def _status(record: dict) -> None:
    record["pid"] = os.getpid()
    try:
        os.write(_status_fd, (json.dumps(record) + "\n").encode())
    except OSError:
        pass  # the code closed or filled it: the parent falls back to the exit status


def main() -> int:
    global _status_fd
    cfg = json.loads(sys.argv[-1])
    _status_fd = cfg["status_fd"]
    try:
        source = sys.stdin.read()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        confine(cfg)
    except BaseException as exc:  # noqa: BLE001 — reported, the code never ran
        _status({"reason": "setup_failed", "detail": f"{type(exc).__name__}: {exc}"})
        return 125
    seen = Attempts()
    sys.addaudithook(seen.hook)
    try:
        exec(compile(source, "<sandbox>", "exec"), {"__name__": "__main__"})  # noqa: S102
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        _status({"reason": "" if code == 0 else f"exit_code {code}", "detail": ""})
        return code
    except BaseException as exc:  # noqa: BLE001 — the code's own failure, classified
        reason = classify(exc, seen)
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        try:
            sys.stderr.write(traceback.format_exc())
        except BaseException:  # noqa: BLE001 — stderr full or closed
            pass
        _status({"reason": reason, "detail": detail[:300]})
        return 1
    _status({"reason": "", "detail": ""})
    return 0


if __name__ == "__main__":
    code = main()
    try:
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001 — e.g. the file-size limit on a big print
        _status({"reason": "file_size_limit", "detail": "flushing stdout"})
        code = code or 1
    os._exit(code)
