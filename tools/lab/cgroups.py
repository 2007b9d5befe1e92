"""One cgroup per lab host, so the hosts' systemds do not share a cgroup tree.

nspawn with `--keep-unit` (needed here: the machine's PID 1 is not systemd) keeps the
cgroup it was started in and puts the container in `payload/` below it. Started from
one cgroup, every host's systemd would create its `system.slice/<unit>` in the same
directory, and one host removing its unit's cgroup broke another's start ("Failed to
attach to cgroup ... No such file or directory", seen as hosts booting `degraded`).
So each nspawn is moved, before it runs, into `rlfleet-lab/<lab>/<host>/` of the
hierarchies systemd uses: the named v1 `systemd` one and the v2 one (hybrid here,
pure v2 elsewhere). Controllers are left alone.
"""

from __future__ import annotations

from pathlib import Path

TOP = "rlfleet-lab"


def hierarchies() -> list[Path]:
    """Mount points of the cgroup2 hierarchy and of v1 `name=systemd`, where they exist."""
    found = []
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mnt, fstype, opts, *_ = line.split()
        if fstype == "cgroup2" or (fstype == "cgroup" and "name=systemd" in opts.split(",")):
            found.append(Path(mnt))
    return found


def host_cgroups(lab: str, host: str) -> list[Path]:
    return [h / TOP / lab / host for h in hierarchies()]


def make(lab: str, host: str) -> list[Path]:
    paths = host_cgroups(lab, host)
    for p in paths:
        p.mkdir(parents=True, exist_ok=True)
    return paths


def joined(paths: list[Path], argv: list[str]) -> list[str]:
    """`argv` run by a shell that first moves itself (the pid `argv` execs into) into these
    cgroups. A shell, not a preexec_fn: that would fork() this threaded process and run
    gRPC's at-fork hooks in the child (see common/procs.with_parent_death)."""
    script = 'while [ "$1" != -- ]; do echo $$ > "$1/cgroup.procs" || exit 1; shift; done; shift; exec "$@"'
    return ["sh", "-c", script, "join-cgroups", *map(str, paths), "--", *argv]


def procs_in(lab: str) -> list[int]:
    """Every process still in one of the lab's cgroups (a host's leftovers)."""
    pids: set[int] = set()
    for h in hierarchies():
        root = h / TOP / lab
        if root.is_dir():
            for procs in root.rglob("cgroup.procs"):
                try:
                    pids |= {int(x) for x in procs.read_text().split()}
                except OSError:
                    continue
    return sorted(pids)


def remove(lab: str) -> list[str]:
    """rmdir the lab's cgroups bottom-up (the containers' own sub-cgroups included);
    returns those that could not be removed (still holding processes)."""
    left = []
    for h in hierarchies():
        root = h / TOP / lab
        if not root.is_dir():
            continue
        for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True) + [root]:
            try:
                d.rmdir()
            except OSError:
                left.append(str(d))
        try:
            (h / TOP).rmdir()  # shared by every lab: goes with the last one
        except OSError:
            pass
    return left


def leftovers(lab: str) -> list[str]:
    return [str(h / TOP / lab) for h in hierarchies() if (h / TOP / lab).exists()]
