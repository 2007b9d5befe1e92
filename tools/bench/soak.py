"""Soak (issue 28): two jobs side by side for hours under faults, on one shared etcd.

    python -m rlfleet.tools.bench.soak --hours 2 --json runs/bench/soak.json

Runs examples/longtail-sim.toml (64 simulated rollouts in one process, the sim trainer)
and examples/arithmetic.toml (the tiny real model) at the same time, each as
``rlfleet run <spec> --no-view --duration <hours> --etcd <endpoints>`` (max_steps lifted so
only the duration ends them; job names ``<name>-soak``), against one 3-member etcd this
bench starts (loopback, 100 ms heartbeat / 1 s election like `rlfleet run`'s own etcd: the
machine is loaded). Both jobs' runs_dir is a tmpfs the bench mounts (``--tmpfs-mib``).

Faults, on a schedule from the start (``fault_schedule``; none in the last ``--quiet-end-s``,
so the jobs end and check their accounting on a whole etcd and a free disk):
  - kill -9 of a random daemon process of either job, every ``--kill-every-min``: picked
    among the processes the jobs' ``members/<role>/<id>`` records name (a pid hosting many
    members, the 64 sim rollouts, is one process); `rlfleet run` restarts it;
  - kill -9 of a random etcd member every ``--etcd-loss-every-min`` (+20 s), started
    again after ``--etcd-down-s``;
  - a full disk every ``--disk-full-every-min`` (+40 s): a filler file takes the tmpfs
    until it refuses (topped up while it lasts) for ``--disk-full-s``, then is removed.

Every ``--sample-s``: per daemon process (both jobs, found by its member records, keyed
job/member/pid; each `rlfleet run` too, as ``rlfleet-run``) VmRSS, open fds and the RSS of
it with its children (reward workers); per job the trainer's last step, the drop totals
and consumed groups of metrics.jsonl and whether its `rlfleet run` still runs; one
progress line. At the end (or Ctrl-C / SIGTERM: both jobs are stopped with SIGTERM and
the record is still written) each job's accounting.json and summary.json are read.

Verdicts, fixed before measuring:
  1. accounting: both runs ended by their duration or a stop (exit 0 or 7) and their
     accounting.json says ok.
  2. no growth: for each process series (a new pid after a restart starts a new series)
     and each of VmRSS, open fds and the RSS with children, the median over the final
     window is at most 10% above the median over the baseline window. w = 15 min (a
     quarter of the run when that is less: trials). A series that lived through both the
     run's baseline window [w, 2w) and its final window (the last w) is judged on them.
     A shorter one (a daemon restarted by a kill) that lived at least 3w is judged on its
     own life: [its start + w, + 2w) against its last w. A series that lived less is not
     judged; the record lists it as short, and says per member how many series were judged.
  3. drop share of arithmetic at most 3% over the run: (staleness + buffer_full drops) /
     prompts claimed, from accounting.json, as tools/bench/drops.py computes it.

Imitates no paper setting: an operations soak. What it does not cover: a whole-machine
loss, etcd's own disk filling (etcd's data is not on the tmpfs), a network partition.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TASKS = ("arithmetic", "longtail-sim")
DROP_SHARE_TASK = "arithmetic"
GROWTH_LIMIT = 0.10          # final median at most 10% above baseline
DROP_SHARE_LIMIT = 0.03
WINDOW_S = 900.0             # the growth verdict's window (a quarter of a shorter run)
MIN_POINTS = 3               # samples a window needs to give a median
METRICS = ("rss_kb", "fds", "tree_rss_kb")
ETCD_PHASE_S, DISK_PHASE_S = 20.0, 40.0   # apart from the kills, so the log reads one fault at a time
STOP_WAIT_S = 180.0          # a stopped `rlfleet run`: its daemons' grace, the accounting, the plots


# -- pure parts: the schedule and the verdicts ---------------------------------------

@dataclass(frozen=True, order=True)
class Fault:
    at_s: float
    kind: str    # kill | etcd_down | etcd_up | disk_fill | disk_free
    n: int = 0   # the n-th fault of its kind (pairs a down with its up)


def fault_schedule(duration_s: float, kill_every_s: float, etcd_every_s: float, etcd_down_s: float,
                   disk_every_s: float, disk_s: float, quiet_end_s: float) -> list[Fault]:
    """Every fault with its undo, sorted by time; one whose undo would fall after
    ``duration_s - quiet_end_s`` is left out. A period <= 0 turns that kind off."""
    end = duration_s - quiet_end_s
    out: list[Fault] = []

    def every(period: float, phase: float, length: float, start: str, stop: str | None) -> None:
        if period <= 0:
            return
        n = 1
        while (t := n * period + phase) + length <= end:
            out.append(Fault(t, start, n))
            if stop:
                out.append(Fault(t + length, stop, n))
            n += 1
    every(kill_every_s, 0.0, 0.0, "kill", None)
    every(etcd_every_s, ETCD_PHASE_S, etcd_down_s, "etcd_down", "etcd_up")
    every(disk_every_s, DISK_PHASE_S, disk_s, "disk_fill", "disk_free")
    return sorted(out)


def verdict_window_s(run_s: float) -> float:
    return min(WINDOW_S, run_s / 4)


def judge_series(points: list[tuple[float, float]], run_end_s: float, w: float, slack_s: float,
                 limit: float = GROWTH_LIMIT) -> dict[str, Any]:
    """One series' growth verdict (see the module docstring). ``points``: (seconds since
    the soak's start, value), in time order; ``slack_s``: one sample interval (a series
    first sampled within it of a window's start covers that window)."""
    s, e = points[0][0], points[-1][0]
    if s <= w + slack_s and e >= run_end_s - slack_s:
        how, base_at, final_at = "run", (w, 2 * w), (run_end_s - w, run_end_s)
    elif e - s >= 3 * w:
        how, base_at, final_at = "own life", (s + w, s + 2 * w), (e - w, e)
    else:
        return {"judged": False, "why": f"short: lived {e - s:.0f} s, from {s:.0f} s to {e:.0f} s"}
    base = [v for t, v in points if base_at[0] <= t < base_at[1]]
    final = [v for t, v in points if final_at[0] <= t <= final_at[1]]
    if len(base) < MIN_POINTS or len(final) < MIN_POINTS:
        return {"judged": False, "why": f"{len(base)} baseline and {len(final)} final samples (< {MIN_POINTS})"}
    b, f = statistics.median(base), statistics.median(final)
    growth = (f - b) / b if b > 0 else (0.0 if f <= 0 else float("inf"))
    return {"judged": True, "windows": how, "baseline": b, "final": f, "growth": round(growth, 4),
            "ok": growth <= limit}


def growth_verdict(samples: list[dict[str, Any]], sample_s: float, jobs: set[str] | None = None,
                   until_s: float | None = None) -> dict[str, Any]:
    """Verdict 2 over the samples' process rows (of ``jobs``; None: all) up to ``until_s``
    (the runs' duration: not the daemons stopping): per series and metric, per member, overall."""
    samples = [x for x in samples if until_s is None or x["t"] <= until_s]
    series: dict[str, list[dict[str, Any]]] = {}
    for sample in samples:
        for p in sample["procs"]:
            if jobs is None or p["job"] in jobs:
                series.setdefault(f"{p['job']}/{p['label']}/{p['pid']}", []).append({**p, "t": sample["t"]})
    if not series:
        return {"ok": False, "why": "no process was sampled"}
    run_end = samples[-1]["t"]
    w = verdict_window_s(run_end)
    per_series, per_member = {}, {}
    for key, rows in series.items():
        judged = {m: judge_series([(r["t"], r[m]) for r in rows if r.get(m) is not None], run_end, w, sample_s)
                  for m in METRICS if any(r.get(m) is not None for r in rows)}
        per_series[key] = judged
        member = per_member.setdefault(key.rsplit("/", 1)[0], {"series": 0, "judged": 0, "ok": True})
        member["series"] += 1
        if any(j["judged"] for j in judged.values()):
            member["judged"] += 1
        member["ok"] = member["ok"] and all(j.get("ok", True) for j in judged.values())
    failed = sorted(f"{k} {m} +{j['growth']:.1%}" for k, js in per_series.items()
                    for m, j in js.items() if j.get("ok") is False)
    return {"ok": not failed, "window_s": w, "run_end_s": run_end, "failed": failed,
            "members_not_judged": sorted(k for k, v in per_member.items() if not v["judged"]),
            "per_member": per_member, "per_series": per_series}


def drop_counts(line: dict[str, Any]) -> tuple[int, int]:
    """(waste, consumed) so far from a training line of metrics.jsonl (tools/bench/drops.py)."""
    from rlfleet.tools.bench.drops import WASTE
    dropped = Counter({k: int(v) for k, v in (line.get("dropped") or {}).items()})
    return sum(dropped[k] for k in WASTE), int(line.get("trained_groups", 0)) + sum(dropped.values())


# -- the processes: what runs, sampled and killed --------------------------------------

@dataclass
class Proc:
    job: str
    label: str           # the member id, or "<first id>+<n>" for a process hosting several
    role: str
    pid: int
    members: list[str] = field(default_factory=list)


def read_procs(store: Any, job: str) -> list[Proc]:
    """The job's daemon processes that run here now, by their member records."""
    from rlfleet.common.keys import JobKeys
    from rlfleet.common.members import members_from
    from rlfleet.common.procs import ProcessId
    keys = JobKeys(job)
    by_pid: dict[int, list[Any]] = {}
    for m in members_from(keys, store.get_prefix(keys.members_prefix)):
        if m.role == "agent" or m.pid <= 0:
            continue
        if ProcessId(m.boot_id, m.pid, m.pid_start).state() == "running":
            by_pid.setdefault(m.pid, []).append(m)
    out = []
    for pid, ms in by_pid.items():
        ids = sorted(m.id for m in ms)
        out.append(Proc(job, ids[0] if len(ids) == 1 else f"{ids[0]}+{len(ids) - 1}", ms[0].role, pid, ids))
    return sorted(out, key=lambda p: p.label)


def proc_usage(pid: int, tree: bool = True) -> dict[str, int | None] | None:
    """VmRSS (kB), open fds, and (``tree``) the RSS with its descendants (kB); None if it is gone."""
    import psutil
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        with_children = (rss + sum(c.memory_info().rss // 1024 for c in psutil.Process(pid).children(recursive=True))
                         if tree else None)
    except (OSError, StopIteration, psutil.Error):
        return None
    return {"rss_kb": rss, "fds": fds, "tree_rss_kb": with_children}


def descends_from(pid: int, roots: set[int]) -> bool:
    """Whether ``pid`` is a descendant of one of ``roots`` (never kill another run's daemon)."""
    import psutil
    try:
        return any(p.pid in roots for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


class MetricsReader:
    """metrics.jsonl followed by offset; only the last training line is kept (a 2-hour
    arithmetic run writes ~70k lines: the soak must not grow with them)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.last = path, 0, None

    def poll(self) -> dict[str, Any] | None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return self.last
        end = chunk.rfind(b"\n")
        if end >= 0:
            self.offset += end + 1
            for raw in chunk[:end].splitlines():
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(line, dict) and "loss" in line:
                    self.last = line
        return self.last


def slim_step_lines(path: Path) -> list[dict[str, Any]]:
    """The training lines with only what drops.windows reads."""
    keep = ("time", "dropped", "trained_groups", "staleness", "wait_s", "pending_groups")
    out = []
    try:
        with open(path, "rb") as f:
            for raw in f:
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(line, dict) and "loss" in line:
                    out.append({k: line[k] for k in keep if k in line})
    except OSError:
        pass
    return out


def used_mib(folder: Path) -> float:
    st = os.statvfs(folder)
    return round((st.f_blocks - st.f_bfree) * st.f_frsize / 2**20, 1)


def mem_available_mib() -> float | None:
    """The machine's MemAvailable: memory a leak outside the sampled processes takes (shm, tmpfs, page cache)."""
    try:
        with open("/proc/meminfo") as f:
            return round(next(int(x.split()[1]) for x in f if x.startswith("MemAvailable:")) / 1024, 1)
    except (OSError, StopIteration):
        return None


def fill(folder: Path, path: Path) -> int:
    """Append to ``path`` until the filesystem refuses; bytes written."""
    chunk, written = b"\0" * (1 << 20), 0
    with open(path, "ab", buffering=0) as f:
        while True:
            st = os.statvfs(folder)
            room = st.f_bavail * st.f_frsize
            if room <= 0:
                return written
            try:
                written += f.write(chunk[:min(len(chunk), room)])
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                return written


# -- the soak ---------------------------------------------------------------------------

@dataclass
class Job:
    task: str
    name: str
    spec: Path
    out: Path
    proc: subprocess.Popen | None = None
    run_dir: Path | None = None
    metrics: MetricsReader | None = None
    alpha: int | None = None   # trainer.max_staleness (drops.windows' "at the bound")
    prev: tuple[int, int] = (0, 0)
    step_seen: tuple[Any, float] = (None, 0.0)   # (last step, when it was first seen)
    exit: int | None = None


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.duration_s = args.hours * 3600
        self.work = Path(tempfile.mkdtemp(prefix="rlfleet-soak-", dir=args.work_root))
        self.runs = self.work / "runs"
        self.filler = self.runs / "soak-filler"
        self.rng = random.Random(args.seed)
        self.stop = threading.Event()
        self.faults: list[dict[str, Any]] = []
        self.pending: list[dict[str, Any]] = []   # kills and etcd restarts awaiting their outcome
        self.samples: list[dict[str, Any]] = []
        self.jobs: list[Job] = []
        self.cluster: Any = None
        self.store: Any = None
        self.t0 = time.monotonic()
        self.t0_unix = time.time()
        self.mounted = False
        self.disk_full = False
        self.down: dict[int, Any] = {}   # n -> etcd member down
        self._followed_at = 0.0
        self.error: str | None = None    # the soak's own traceback, if it failed
        self.stopped_at = float("inf")   # when a stop was requested (Ctrl-C, SIGTERM)

    def t(self) -> float:
        return time.monotonic() - self.t0

    def say(self, text: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} t={self.t() / 60:6.2f} min  {text}", flush=True)

    def log_fault(self, kind: str, **what: Any) -> dict[str, Any]:
        entry = {"t": round(self.t(), 1), "time": round(time.time(), 1), "kind": kind, **what}
        self.faults.append(entry)
        self.say(f"FAULT {kind}: " + ", ".join(f"{k}={v}" for k, v in what.items()))
        return entry

    # -- set-up and tear-down -------------------------------------------------------------
    def setup(self) -> None:
        from rlfleet.common.etcd_store import EtcdStore
        from rlfleet.tools.bench.spec_variants import write_variant
        from rlfleet.tools.etcd_local import EtcdCluster
        if os.geteuid() != 0:
            raise SystemExit("soak: mounting the runs' tmpfs needs root")
        self.runs.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.args.tmpfs_mib}m", "tmpfs", str(self.runs)],
                       check=True)
        self.mounted = True
        self.cluster = EtcdCluster(3, base_dir=self.work / "etcd", heartbeat_ms=100, election_ms=1000).start()
        self.store = EtcdStore(self.cluster.endpoints_arg, timeout_s=2.0)
        for task in TASKS:
            def change(spec: dict[str, Any]) -> None:
                spec["job"]["name"] = f"{spec['job']['name']}-soak"
                spec["job"]["runs_dir"] = str(self.runs)
                spec["trainer"]["max_steps"] = 10**7
            spec = write_variant(self.args.examples / f"{task}.toml", "soak", change)
            parsed = tomllib.loads(spec.read_text())
            name = parsed["job"]["name"]
            self.jobs.append(Job(task, name, spec, self.work / f"{name}.out",
                                 alpha=parsed["trainer"].get("max_staleness")))
        self.say(f"work dir {self.work}, etcd {self.cluster.endpoints_arg}, runs on a "
                 f"{self.args.tmpfs_mib} MiB tmpfs at {self.runs}")

    def launch(self) -> None:
        from rlfleet.common.procs import with_parent_death
        self.t0, self.t0_unix = time.monotonic(), time.time()
        for job in self.jobs:
            cmd = [sys.executable, "-m", "rlfleet.tools.cli", "run", str(job.spec), "--no-view",
                   "--duration", str(self.duration_s), "--etcd", self.cluster.endpoints_arg]
            with open(job.out, "ab") as out:  # SIGTERM if the soak dies: the run stops cleanly
                job.proc = subprocess.Popen(with_parent_death(cmd, signal.SIGTERM), stdout=out,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, cwd=REPO)
            self.say(f"started {job.name}: pid {job.proc.pid}, output {job.out}")

    def find_run_dirs(self) -> None:
        for job in self.jobs:
            if job.run_dir is None and job.out.exists():
                for line in job.out.read_text(errors="replace").splitlines():
                    if line.startswith("run dir:"):
                        job.run_dir = Path(line.split("run dir:", 1)[1].strip())
                        job.metrics = MetricsReader(job.run_dir / "metrics.jsonl")

    def teardown(self) -> None:
        """Faults undone, the runs stopped (SIGTERM) and waited for, etcd stopped, the
        run dirs copied off the tmpfs (without checkpoints), the tmpfs unmounted."""
        if self.disk_full:
            self.free_disk(0)
        for n in list(self.down):
            self.etcd_up(n)
        for job in self.jobs:
            if job.proc is not None and job.proc.poll() is None:
                job.proc.send_signal(signal.SIGTERM)
        for job in self.jobs:
            if job.proc is None:
                continue
            try:
                job.exit = job.proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.say(f"{job.name}: rlfleet run still there {STOP_WAIT_S:.0f} s after SIGTERM; SIGKILL")
                job.proc.kill()
                job.exit = job.proc.wait()
        self.find_run_dirs()
        if self.store is not None:
            self.store.close()
        if self.cluster is not None:
            self.cluster.stop()
        for job in self.jobs:
            job.spec.unlink(missing_ok=True)
            if job.run_dir is not None and job.run_dir.exists():
                keep = self.work / "kept" / job.name
                shutil.copytree(job.run_dir, keep, ignore=shutil.ignore_patterns("checkpoints", "credentials"),
                                dirs_exist_ok=True)
                job.run_dir = keep
        if self.mounted:
            if subprocess.run(["umount", str(self.runs)]).returncode != 0:
                subprocess.run(["umount", "-l", str(self.runs)])
            self.mounted = False

    # -- faults -----------------------------------------------------------------------------
    def all_procs(self) -> list[Proc]:
        from rlfleet.common.store import StoreUnavailable
        out = []
        for job in self.jobs:
            try:
                out += read_procs(self.store, job.name)
            except StoreUnavailable:
                pass
        return out

    def kill_daemon(self) -> None:
        import psutil
        roots = {j.proc.pid for j in self.jobs if j.proc is not None}
        procs = [p for p in self.all_procs() if p.pid not in roots and descends_from(p.pid, roots)]
        if not procs:
            self.log_fault("kill", skipped="no daemon process found")
            return
        p = self.rng.choice(procs)
        try:
            children = psutil.Process(p.pid).children(recursive=True)
        except psutil.Error:
            children = []
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            self.log_fault("kill", job=p.job, member=p.label, pid=p.pid, skipped="gone before the kill")
            return
        entry = self.log_fault("kill", job=p.job, member=p.label, role=p.role, pid=p.pid,
                               members=len(p.members), children=[c.pid for c in children])
        self.pending.append({"entry": entry, "kind": "kill", "proc": p, "children": children, "at": self.t()})

    def etcd_down(self, n: int) -> None:
        m = self.rng.choice([m for m in self.cluster.members if m.alive()])
        self.cluster.kill_member(m)
        self.down[n] = m
        self.log_fault("etcd_down", member=m.name, endpoint=m.endpoint)

    def etcd_up(self, n: int) -> None:
        m = self.down.pop(n, None)
        if m is None:
            return
        self.cluster.start_member(m, wait=False)
        entry = self.log_fault("etcd_up", member=m.name)
        self.pending.append({"entry": entry, "kind": "etcd_up", "member": m, "at": self.t()})

    def fill_disk(self, n: int) -> None:
        written = fill(self.runs, self.filler)
        self.disk_full = True
        self.log_fault("disk_fill", n=n, filler_mib=round(written / 2**20, 1))

    def free_disk(self, n: int) -> None:
        size = self.filler.stat().st_size if self.filler.exists() else 0
        self.filler.unlink(missing_ok=True)
        self.disk_full = False
        self.log_fault("disk_free", n=n, filler_mib=round(size / 2**20, 1))

    def follow_up(self) -> None:
        """Kills: when the member is registered again (a new pid), which children outlived
        their daemon. etcd restarts: when the member is healthy."""
        if not self.pending or time.monotonic() - self._followed_at < 2.0:
            return
        self._followed_at = time.monotonic()
        procs = None
        for item in list(self.pending):
            age = self.t() - item["at"]
            entry = item["entry"]
            if item["kind"] == "etcd_up":
                try:
                    self.cluster.wait_healthy(0.2, members=[item["member"]])
                    entry["healthy_after_s"] = round(self.t() - item["at"], 1)
                except (TimeoutError, RuntimeError) as exc:
                    if age < 120:
                        continue
                    entry["healthy_after_s"] = None
                    entry["problem"] = str(exc)[:300]
                self.pending.remove(item)
                continue
            if "orphans" not in entry and age >= 10:
                entry["orphans"] = [c.pid for c in item["children"] if c.is_running()]
                if entry["orphans"]:
                    self.say(f"{entry['member']} ({entry['job']}): children {entry['orphans']} outlived "
                             f"their daemon (pid {entry['pid']}) by {age:.0f} s")
            if "back_after_s" not in entry:
                procs = procs if procs is not None else self.all_procs()
                p = item["proc"]
                new = next((q for q in procs if q.job == p.job and q.label == p.label and q.pid != p.pid), None)
                if new is not None:
                    entry["back_after_s"], entry["new_pid"] = round(age, 1), new.pid
                elif age >= 300:
                    entry["back_after_s"] = None  # not registered again within 5 minutes
            if "orphans" in entry and "back_after_s" in entry:
                self.pending.remove(item)

    def do(self, fault: Fault) -> None:
        if fault.kind == "kill":
            self.kill_daemon()
        elif fault.kind == "etcd_down":
            self.etcd_down(fault.n)
        elif fault.kind == "etcd_up":
            self.etcd_up(fault.n)
        elif fault.kind == "disk_fill":
            self.fill_disk(fault.n)
        elif fault.kind == "disk_free":
            self.free_disk(fault.n)

    # -- samples ------------------------------------------------------------------------------
    def sample(self) -> dict[str, Any]:
        self.find_run_dirs()
        rows = []
        for p in self.all_procs():
            use = proc_usage(p.pid)
            if use is not None:
                rows.append({"job": p.job, "label": p.label, "role": p.role, "pid": p.pid, **use})
        jobs = {}
        for job in self.jobs:
            # its children are the job's daemons: no tree figure of its own
            if job.proc is not None and (use := proc_usage(job.proc.pid, tree=False)) is not None:
                rows.append({"job": job.name, "label": "rlfleet-run", "role": "supervisor", "pid": job.proc.pid,
                             **use})
            line = job.metrics.poll() if job.metrics is not None else None
            waste, consumed = drop_counts(line) if line else (0, 0)
            d_waste, d_consumed = waste - job.prev[0], consumed - job.prev[1]
            job.prev = (waste, consumed)
            step = line.get("step") if line else None
            if step != job.step_seen[0]:
                job.step_seen = (step, self.t())
            jobs[job.name] = {"running": job.proc is not None and job.proc.poll() is None,
                              "no_step_s": round(self.t() - job.step_seen[1], 1),
                              "step": line.get("step") if line else None, "waste": waste, "consumed": consumed,
                              "dropped": dict(line.get("dropped") or {}) if line else {},
                              "drop_share": round(waste / consumed, 4) if consumed else None,
                              "drop_share_since_last": round(d_waste / d_consumed, 4) if d_consumed > 0 else None}
        for m in self.cluster.members:  # not judged: what a long run does to etcd, for the record
            if m.alive() and (use := proc_usage(m.proc.pid, tree=False)) is not None:
                db = m.data_dir / "member" / "snap" / "db"
                rows.append({"job": "etcd", "label": m.name, "role": "etcd", "pid": m.proc.pid, **use,
                             "db_mib": round(db.stat().st_size / 2**20, 1) if db.exists() else None})
        sample = {"t": round(self.t(), 1), "time": round(time.time(), 1), "procs": rows, "jobs": jobs,
                  "tmpfs_used_mib": used_mib(self.runs), "shm_used_mib": used_mib(Path("/dev/shm")),
                  "mem_available_mib": mem_available_mib(), "load_1m": round(os.getloadavg()[0], 2)}
        self.samples.append(sample)
        return sample

    def progress(self, s: dict[str, Any]) -> str:
        parts = []
        for name, j in s["jobs"].items():
            procs = [p for p in s["procs"] if p["job"] == name and p["role"] != "supervisor"]
            share = f"{j['drop_share']:.1%}" if j["drop_share"] is not None else "-"
            stall = f" (no step for {j['no_step_s']:.0f} s)" if j["no_step_s"] >= 30 else ""
            parts.append(f"{name}: {'up' if j['running'] else 'ENDED'} step {j['step']}{stall} drops {share} "
                         f"of {j['consumed']}, {len(procs)} procs, rss {sum(p['rss_kb'] for p in procs) / 2**20:.2f} "
                         f"GiB, fds {sum(p['fds'] for p in procs)}")
        etcd = [p for p in s["procs"] if p["job"] == "etcd"]
        parts.append(f"etcd {len(etcd)} up, rss {sum(p['rss_kb'] for p in etcd) / 2**10:.0f} MiB, "
                     f"db {max((p['db_mib'] or 0 for p in etcd), default=0):.0f} MiB")
        last = self.faults[-1] if self.faults else None
        return (" | ".join(parts) + f" | tmpfs {s['tmpfs_used_mib']:.0f}/{self.args.tmpfs_mib} MiB, "
                f"/dev/shm {s['shm_used_mib']:.0f} MiB, available {s['mem_available_mib']:.0f} MiB, "
                f"load {s['load_1m']}, {len(self.faults)} faults"
                + (f" (last {last['kind']} at {last['t'] / 60:.1f} min)" if last else ""))

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> None:
        a = self.args
        schedule = fault_schedule(self.duration_s, a.kill_every_min * 60, a.etcd_loss_every_min * 60, a.etcd_down_s,
                                  a.disk_full_every_min * 60, a.disk_full_s,
                                  min(a.quiet_end_s, self.duration_s / 10))
        self.say(f"{len(schedule)} scheduled faults: {dict(Counter(f.kind for f in schedule))}")
        self.launch()
        next_sample = a.sample_s
        while not self.stop.is_set():
            while schedule and schedule[0].at_s <= self.t():
                self.do(schedule.pop(0))
            if self.disk_full:
                fill(self.runs, self.filler)  # what the jobs freed is taken again: the disk stays full
            self.follow_up()
            if self.t() >= next_sample:
                next_sample += a.sample_s
                self.say(self.progress(self.sample()))
            if all(j.proc.poll() is not None for j in self.jobs):
                self.say("both runs ended")
                break
            if self.t() > self.duration_s + STOP_WAIT_S:
                self.say(f"the runs are still there {STOP_WAIT_S:.0f} s after their duration: stopping them")
                break
            self.stop.wait(0.5)
        if self.stop.is_set():
            self.stopped_at = self.t()
            self.say("stop requested: stopping both runs (SIGTERM)")

    def record(self) -> dict[str, Any]:
        from rlfleet.tools.bench.drops import WASTE, windows
        from rlfleet.tools.exit_codes import RUN_ENDED
        window_s = min(self.args.window_min * 60, max(self.duration_s / 6, 60.0))
        jobs = {}
        for job in self.jobs:
            r: dict[str, Any] = {"task": job.task, "exit": job.exit, "run_dir": str(job.run_dir),
                                 "output": str(job.out)}
            acc_path = job.run_dir / "accounting.json" if job.run_dir else None
            acc = json.loads(acc_path.read_text()) if acc_path and acc_path.exists() else None
            summ_path = job.run_dir / "summary.json" if job.run_dir else None
            r["summary"] = json.loads(summ_path.read_text()) if summ_path and summ_path.exists() else None
            r["accounting"] = acc
            r["accounting_ok"] = bool(acc and acc.get("ok") and job.exit in RUN_ENDED)
            if acc and acc.get("claimed"):
                dropped = Counter(acc.get("dropped", {}))
                r["drop_share"] = round(sum(dropped[k] for k in WASTE) / int(acc["claimed"]), 4)
            if job.run_dir is not None:
                r["windows"] = windows(slim_step_lines(job.run_dir / "metrics.jsonl"), self.t0_unix, window_s,
                                       job.alpha)
                r["drop_share_by_window"] = [w["drop_share"] for w in r["windows"]]
                out = job.out.read_text(errors="replace") if job.out.exists() else ""
                r["restarts_logged"] = out.count("restarted ")
                r["journal_lines_skipped"] = out.count("unreadable, skipped")
                r["last_lines"] = out.splitlines()[-6:]
                r["log_problems"] = log_problems(job.run_dir / "logs")
            running = [x["jobs"][job.name] for x in self.samples if x["jobs"][job.name]["running"]
                       and x["t"] <= min(self.duration_s, self.stopped_at)]
            r["longest_no_step_s"] = max((x["no_step_s"] for x in running), default=None)
            jobs[job.name] = r
        names = {j.name for j in self.jobs}
        until = min(self.duration_s, self.stopped_at)
        growth = (growth_verdict(self.samples, self.args.sample_s, names, until) if self.samples
                  else {"ok": False, "why": "no samples"})
        etcd = growth_verdict(self.samples, self.args.sample_s, {"etcd"}, until) if self.samples else {}
        arith = next((r for r in jobs.values() if r["task"] == DROP_SHARE_TASK), {})
        share = arith.get("drop_share")
        verdicts = {
            "accounting_ok_both": all(r["accounting_ok"] for r in jobs.values()),
            "no_growth": growth["ok"],
            "drop_share_arithmetic": share,
            "drop_share_ok": share is not None and share <= DROP_SHARE_LIMIT,
        }
        verdicts["ok"] = (verdicts["accounting_ok_both"] and verdicts["no_growth"] and verdicts["drop_share_ok"]
                          and self.error is None)
        return {"command": "python -m rlfleet.tools.bench.soak " + " ".join(sys.argv[1:]),
                **provenance(), "hours": self.args.hours, "ran_s": round(self.t(), 1),
                "stopped_early": self.stop.is_set(), "error": self.error, "work_dir": str(self.work),
                "window_s": window_s,
                "verdicts": verdicts, "growth": growth, "etcd_growth_not_judged": etcd, "jobs": jobs,
                "fault_summary": fault_summary(self.faults), "faults": self.faults, "samples": self.samples}


def log_problems(log_dir: Path, top: int = 8) -> dict[str, dict[str, int]]:
    """Per daemon log: its warning and error records counted by event (or the message's
    start), the most frequent first; torn lines counted as "unparsable line"."""
    out = {}
    for path in sorted(log_dir.glob("*.log")):
        counts: Counter[str] = Counter()
        with open(path, errors="replace") as f:
            for raw in f:
                try:
                    rec = json.loads(raw)
                except ValueError:
                    counts["unparsable line"] += 1
                    continue
                if isinstance(rec, dict) and rec.get("level") in ("warning", "error", "critical"):
                    what = rec.get("event") or re.sub(r"\d+", "N", str(rec.get("msg", "")))[:80]  # ids alike
                    counts[f"{rec['level']}: {what}"] += 1
        if counts:
            out[path.stem] = dict(counts.most_common(top))
    return out


def fault_summary(faults: list[dict[str, Any]]) -> dict[str, Any]:
    """How many of each, how long the killed daemons and the etcd members took to come back."""
    kills = [f for f in faults if f["kind"] == "kill" and "skipped" not in f]
    back = sorted(f["back_after_s"] for f in kills if f.get("back_after_s") is not None)
    healthy = sorted(f["healthy_after_s"] for f in faults if f.get("healthy_after_s") is not None)
    return {"count": dict(Counter(f["kind"] for f in faults)), "kills_skipped": sum("skipped" in f for f in faults),
            "kills_back": len(back), "kills_not_back": sum(f.get("back_after_s", 0) is None for f in kills),
            "back_after_s_median": statistics.median(back) if back else None,
            "back_after_s_max": back[-1] if back else None,
            "orphaned_children": sum(len(f.get("orphans", [])) for f in kills),
            "etcd_healthy_after_s_max": healthy[-1] if healthy else None}


def provenance() -> dict[str, Any]:
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, cwd=REPO).stdout.strip()
        except OSError:
            return ""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"commit": git("rev-parse", "HEAD"), "dirty_files": len(git("status", "--porcelain").splitlines()),
            "machine": f"{platform.node()} {os.cpu_count()} cores {platform.machine()} {mem / 2**30:.0f} GiB",
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def plot(record: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(3, 1, figsize=(14, 11), sharex=True)
    series: dict[str, list[tuple[float, float, float]]] = {}
    for s in record["samples"]:
        for p in s["procs"]:
            series.setdefault(f"{p['job']}/{p['label']}|{p['pid']}", []).append(
                (s["t"] / 60, p["rss_kb"] / 1024, p["fds"]))
    colors: dict[str, Any] = {}
    cmap = plt.get_cmap("tab20")
    for key, pts in series.items():
        member = key.split("|")[0]
        first = member not in colors
        colors.setdefault(member, cmap(len(colors) % 20))
        t, rss, fds = zip(*pts)
        axes[0].plot(t, rss, color=colors[member], lw=1, label=member if first else None)
        axes[1].plot(t, fds, color=colors[member], lw=1)
    for name, job in record["jobs"].items():
        ws = [w for w in job.get("windows", []) if w["drop_share"] is not None]
        if ws:  # each window drawn over its width
            x = [w["start_min"] for w in ws] + [ws[-1]["start_min"] + record["window_s"] / 60]
            y = [100 * w["drop_share"] for w in ws]
            axes[2].step(x, y + y[-1:], where="post", label=name)
    if w := record["growth"].get("window_s"):
        end = record["growth"]["run_end_s"]
        for ax in axes[:2]:  # the growth verdict's windows
            ax.axvspan(w / 60, 2 * w / 60, color="tab:green", alpha=0.08)
            ax.axvspan((end - w) / 60, end / 60, color="tab:green", alpha=0.08)
    style = {"kill": ("grey", ":"), "etcd_down": ("tab:orange", "--"), "etcd_up": ("tab:orange", ":"),
             "disk_fill": ("tab:red", "--"), "disk_free": ("tab:red", ":")}
    for ax in axes:
        for f in record["faults"]:
            color, ls = style.get(f["kind"], ("black", ":"))
            ax.axvline(f["t"] / 60, color=color, ls=ls, lw=0.8, alpha=0.7)
    axes[0].set_ylabel("RSS (MiB) per daemon process")
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the lines, not over them
    axes[1].set_ylabel("open fds per daemon process")
    axes[2].set_ylabel("drop share per window (%)")
    axes[2].set_xlabel("minutes since start (faults: grey kill -9, orange etcd member, red disk full; "
                       "green: the growth verdict's windows)")
    axes[2].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    v = record["verdicts"]
    fig.suptitle(f"soak {record['hours']} h: accounting ok both {v['accounting_ok_both']}, no growth {v['no_growth']}, "
                 f"arithmetic drop share {v['drop_share_arithmetic']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hours", type=float, default=2.0)
    ap.add_argument("--kill-every-min", type=float, default=2.0, help="kill -9 of a daemon (<= 0: none)")
    ap.add_argument("--etcd-loss-every-min", type=float, default=20.0)
    ap.add_argument("--etcd-down-s", type=float, default=30.0)
    ap.add_argument("--disk-full-every-min", type=float, default=60.0)
    ap.add_argument("--disk-full-s", type=float, default=60.0)
    ap.add_argument("--quiet-end-s", type=float, default=120.0, help="no fault this close to the end "
                    "(at most a tenth of the run)")
    ap.add_argument("--sample-s", type=float, default=30.0)
    ap.add_argument("--window-min", type=float, default=5.0, help="drop share window (at most a sixth of the run)")
    ap.add_argument("--tmpfs-mib", type=int, default=1024, help="the runs' tmpfs")
    ap.add_argument("--seed", type=int, default=0, help="which daemons and etcd members are killed")
    ap.add_argument("--examples", type=Path, default=REPO / "examples")
    ap.add_argument("--work-root", type=Path, default=None, help="where the work dir goes (default: $TMPDIR)")
    ap.add_argument("--json", type=Path, default=Path("runs/bench/soak.json"))
    ap.add_argument("--png", type=Path, default=None, help="default: the JSON's path with .png")
    args = ap.parse_args(argv)
    soak = Soak(args)

    def request_stop(*_: object) -> None:
        soak.stop.set()
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        soak.setup()
        try:
            soak.run()
        except Exception:  # noqa: BLE001 — a bug of the soak's own: the record is still written
            soak.error = traceback.format_exc()
            print(soak.error, file=sys.stderr, flush=True)
    finally:
        soak.teardown()
    record = soak.record()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    png = args.png or args.json.with_suffix(".png")
    plot(record, png)
    v = record["verdicts"]
    for name, r in record["jobs"].items():
        print(f"{name}: exit {r['exit']}, accounting ok {r['accounting_ok']}, drop share {r.get('drop_share')}, "
              f"{r.get('restarts_logged')} restarts logged, longest without a step {r.get('longest_no_step_s')} s, "
              f"{r.get('journal_lines_skipped')} journal lines skipped at the accounting")
    print(f"faults: {json.dumps(record['fault_summary'])}")
    print(f"verdicts: {json.dumps(v)}; growth failures: {record['growth'].get('failed')}, "
          f"members not judged: {record['growth'].get('members_not_judged')}")
    print(f"wrote {args.json} and {png}")
    return 0 if v["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
