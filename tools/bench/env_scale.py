"""The env-host at scale: N concurrent EnvManagers in one env-host on the simulated fleet.

    python -m rlfleet.tools.bench.env_scale --managers 500,1000,2000 \\
        --json runs/bench/env_scale.json --plot runs/bench/env_scale.png

For every N it runs the real daemons (`rlfleet run`) on examples/agentic-sim.toml with
one env-host of ``max_concurrent = N`` (env mode async, no claim pacing), multi-turn
episodes whose environment steps wait ``--latency-s`` wall seconds on average (so that
N trajectories really are in flight at once: most of them are waiting on their
environment, as agentic ones do), and sim rollouts with more slots than the turns being
generated at any moment, so the rollouts are not the bottleneck.

While the run lasts it scrapes the env-host's own /metrics every 2 s (its URL is in the
env-host's "env loop started" log line) and reports, between the first scrape after
``--warmup-s`` and the last one:

- ``cpu_s_per_1000``: the env-host process's CPU seconds (``process_cpu_seconds_total``:
  user + system, every thread, from /proc/self/stat) per 1,000 finished trajectories;
- ``loop_lag_p50_s/p99_s`` (interpolated in the buckets of ``rlfleet_env_loop_lag_seconds``)
  and ``loop_lag_max_s`` (``rlfleet_env_loop_lag_max_seconds``, which holds the last
  10 to 20 s), the event loop's lateness (daemons/env_host/loop_lag.py);
- ``trajectories_per_s`` and ``in_flight_mean`` (``rlfleet_env_running_trajectory_seconds_total``
  over the window: the mean number of trajectories running);
- validity: the sim rollouts' lag within docs/design/sim.md's 5%, no daemon restarted, and a mean
  in flight of at least 90% of N.

``--profile DIR`` runs the env-host's event-loop thread under cProfile
(``RLFLEET_ENV_PROFILE``) and prints its top functions.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from rlfleet.tools.bench.longtail import MAX_LAG, _jsonl
from rlfleet.tools.bench.output import finish, provenance, write_json
from rlfleet.tools.bench.spec_variants import write_variant

BASE = Path(__file__).resolve().parents[2] / "examples" / "agentic-sim.toml"
SCRAPE_S = 2.0
# Of N: below it the run did not hold N managers and says so. The env-host claims in
# batches of a quarter of its capacity's prompts, so its mean sits about 1/8 below N.
MIN_IN_FLIGHT = 0.8
_METRIC = re.compile(r'^(\w+)(?:\{([^}]*)\})? (\S+)$')
_URL = re.compile(r"metrics (http://\S+/metrics)")


# -- the spec of one run ---------------------------------------------------------------------
def spec_for(n: int, latency_s: float, rollouts: int, slots: int, engine_time_scale: float,
             suffix: str = "") -> Path:
    def change(spec: dict[str, Any]) -> None:
        spec["job"]["name"] = f"env-scale-{n}{suffix}"
        env = spec["task"]["env"]
        scale = env.get("time_scale", 1.0)
        env["step_latency_mean_s"] = round(latency_s / scale, 3)  # model seconds
        env["step_latency_std_s"] = round(latency_s / 4 / scale, 3)
        env["failure_rate"] = 0.0
        engine = spec["rollout"]["engine"]
        engine["rollouts"] = rollouts
        engine["max_batch"] = engine["roofline_batch"] = slots
        # A slower clock for the engines than the example's 0.05: its 40-token actions took
        # ~40 ms of wall time, so any wait for a busy machine's CPU was most of a request's
        # modelled latency and the run was invalid (lag); longer actions, same reason.
        engine["time_scale"] = engine_time_scale
        engine["lengths"].update(median=120, p99=400)
        host = spec["env_host"]
        host.update(max_concurrent=n, env_mode="async", pace_claims=False,
                    turn_timeout_s=60, trajectory_timeout_s=600)
    return write_variant(BASE, f"scale-{n}{suffix}", change)


# -- scraping the env-host -------------------------------------------------------------------
def parse(text: str) -> dict[str, float]:
    """The env-host's figures this bench uses, summed over labels but ``le``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m is None:
            continue
        name, labels, value = m.groups()
        if name == "rlfleet_env_loop_lag_seconds_bucket":
            le = re.search(r'le="([^"]+)"', labels or "")
            key = f"lag_le:{le.group(1) if le else '?'}"
        elif name in ("process_cpu_seconds_total", "rlfleet_env_trajectories_total", "rlfleet_env_turns_total",
                      "rlfleet_env_running_trajectory_seconds_total", "rlfleet_env_loop_lag_seconds_count",
                      "rlfleet_env_loop_lag_max_seconds"):
            key = name
        else:
            continue
        out[key] = out.get(key, 0.0) + float(value)
    return out


class Scraper(threading.Thread):
    """Finds the env-host's metrics URL in its log, then scrapes it every SCRAPE_S."""

    def __init__(self, run_dir: list[Path], proc: subprocess.Popen) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.proc = run_dir, proc
        self.url = ""
        self.scrapes: list[tuple[float, dict[str, float]]] = []

    def run(self) -> None:
        while self.proc.poll() is None:
            if not self.url and self.run_dir:
                log = self.run_dir[0] / "logs" / "env-host-0.log"
                if log.exists():
                    m = _URL.search(log.read_text(errors="replace"))
                    self.url = m.group(1) if m else ""
            if self.url:
                try:
                    with urllib.request.urlopen(self.url, timeout=2) as r:
                        self.scrapes.append((time.monotonic(), parse(r.read().decode())))
                except OSError:
                    pass  # stopping
            time.sleep(SCRAPE_S)


def run_once(spec: Path, duration_s: float, profile: Path | None) -> tuple[Path, list[str], Scraper, int]:
    env = dict(os.environ)
    if profile is not None:
        env["RLFLEET_ENV_PROFILE"] = str(profile.resolve())
    cmd = [sys.executable, "-m", "rlfleet.tools.cli", "run", str(spec), "--no-view", "--duration", str(duration_s)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    run_dir: list[Path] = []
    scraper = Scraper(run_dir, proc)
    scraper.start()
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if not run_dir and (m := re.match(r"run dir: (\S+)", line)):
            run_dir.append(Path(m.group(1)))
    code = proc.wait()
    scraper.join(SCRAPE_S + 3)
    if not run_dir:
        raise SystemExit(f"{spec}: rlfleet run printed no run dir (exit {code}):\n{''.join(lines[-40:])}")
    return run_dir[0], lines, scraper, code


# -- figures -----------------------------------------------------------------------------------
def lag_quantile(first: dict[str, float], last: dict[str, float], q: float) -> float | None:
    """The q-quantile of the lag samples between two scrapes, linear within a bucket."""
    bounds = sorted((float(k.split(":", 1)[1]), k) for k in last if k.startswith("lag_le:") and k != "lag_le:+Inf")
    total = last.get("lag_le:+Inf", 0.0) - first.get("lag_le:+Inf", 0.0)
    if total <= 0:
        return None
    want, below, lower = q * total, 0.0, 0.0
    for bound, key in bounds:
        cum = last[key] - first.get(key, 0.0)
        if cum >= want:
            inside = cum - below
            return round(lower + (bound - lower) * ((want - below) / inside if inside else 1.0), 5)
        below, lower = cum, bound
    return round(bounds[-1][0], 5) if bounds else None  # above the last bound: at least it


def sim_lag(run_dir: Path) -> float:
    lags: list[float] = []
    for path in sorted((run_dir / "sim").glob("*.json")):
        try:
            lags += [r["lag"] for r in json.loads(path.read_text())["rollouts"].values()]
        except (OSError, ValueError, KeyError):
            pass
    for path in sorted((run_dir / "sim").glob("*.jsonl")):
        lags += [s.get("max_lag", 0.0) for s in _jsonl(path)]
    return round(max(lags, default=0.0), 5)


def measure(n: int, run_dir: Path, lines: list[str], scraper: Scraper, code: int, warmup_s: float,
            latency_s: float) -> dict[str, Any]:
    record: dict[str, Any] = {"managers": n, "latency_s": latency_s, "run_dir": str(run_dir), "exit": code}
    scrapes = scraper.scrapes
    problems = []
    if len(scrapes) >= 2:
        start = scrapes[0][0] + warmup_s
        window = [s for s in scrapes if s[0] >= start] or scrapes[-2:]
        (t0, a), (t1, b) = window[0], window[-1]
        dt = max(t1 - t0, 1e-9)
        d = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in b}
        traj = d.get("rlfleet_env_trajectories_total", 0.0)
        record.update(
            window_s=round(dt, 1), trajectories=int(traj), trajectories_per_s=round(traj / dt, 1),
            turns_per_s=round(d.get("rlfleet_env_turns_total", 0.0) / dt, 1),
            cpu_s=round(d.get("process_cpu_seconds_total", 0.0), 2),
            cpu_cores=round(d.get("process_cpu_seconds_total", 0.0) / dt, 3),
            cpu_s_per_1000=round(1000 * d.get("process_cpu_seconds_total", 0.0) / traj, 3) if traj else None,
            in_flight_mean=round(d.get("rlfleet_env_running_trajectory_seconds_total", 0.0) / dt, 1),
            loop_lag_p50_s=lag_quantile(a, b, 0.5), loop_lag_p99_s=lag_quantile(a, b, 0.99),
            loop_lag_samples=int(d.get("lag_le:+Inf", 0.0)),
            # The gauge holds the last 10-20 s: scrapes from 20 s into the window see only it.
            loop_lag_max_s=round(max((s[1].get("rlfleet_env_loop_lag_max_seconds", 0.0) for s in window
                                      if s[0] >= t0 + 20) or [b.get("rlfleet_env_loop_lag_max_seconds", 0.0)]), 4))
        if record["in_flight_mean"] < MIN_IN_FLIGHT * n:
            problems.append(f"mean in flight {record['in_flight_mean']} < {MIN_IN_FLIGHT:.0%} of {n}")
    else:
        problems.append(f"{len(scrapes)} scrape(s) of the env-host's metrics")
    record["sim_max_lag"] = sim_lag(run_dir)
    if record["sim_max_lag"] > MAX_LAG:
        problems.append(f"sim lag {record['sim_max_lag']:.3f} > {MAX_LAG}")
    restarts = next((line.strip().removeprefix("restarts").strip() for line in lines
                     if line.strip().startswith("restarts ")), "unknown")
    record["restarts"] = restarts
    if restarts != "none":
        problems.append(f"daemons restarted: {restarts}")
    record["valid"] = not problems
    if problems:
        record["invalid_because"] = "; ".join(problems)
    return record


def print_profile(path: Path, top: int = 25) -> None:
    if not path.exists():
        print(f"   (no profile at {path})")
        return
    stats = pstats.Stats(str(path))
    stats.sort_stats("tottime").print_stats(top)


def table(records: list[dict[str, Any]]) -> str:
    head = ("N", "label", "in flight", "traj/s", "CPU s/1000 traj", "CPU cores", "lag p50 ms", "lag p99 ms",
            "lag max ms", "sim lag", "valid")
    rows = [head]
    ms = lambda v: "-" if v is None else f"{1000 * v:.1f}"  # noqa: E731
    for r in records:
        rows.append((str(r["managers"]), r.get("label", ""), str(r.get("in_flight_mean", "-")),
                     str(r.get("trajectories_per_s", "-")), str(r.get("cpu_s_per_1000", "-")),
                     str(r.get("cpu_cores", "-")), ms(r.get("loop_lag_p50_s")), ms(r.get("loop_lag_p99_s")),
                     ms(r.get("loop_lag_max_s")), f"{r['sim_max_lag']:.3f}", "yes" if r["valid"] else "NO"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for label in dict.fromkeys(r.get("label", "") for r in records):
        rs = sorted((r for r in records if r.get("label", "") == label and r.get("cpu_s_per_1000")),
                    key=lambda r: r["managers"])
        if not rs:
            continue
        xs = [r["managers"] for r in rs]
        ax1.plot(xs, [r["cpu_s_per_1000"] for r in rs], "o-", label=label or "env-host")
        ax2.plot(xs, [1000 * (r["loop_lag_p99_s"] or 0) for r in rs], "o-", label=f"{label} p99".strip())
        ax2.plot(xs, [1000 * (r["loop_lag_max_s"] or 0) for r in rs], "x--", label=f"{label} max".strip())
    ax1.set(xlabel="concurrent EnvManagers (max_concurrent)", ylabel="env-host CPU s / 1,000 trajectories",
            title="CPU per trajectory", ylim=(0, None))
    ax2.set(xlabel="concurrent EnvManagers (max_concurrent)", ylabel="ms", title="event-loop lag", ylim=(0, None))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--managers", default="500,1000,2000", help="comma-separated max_concurrent values")
    ap.add_argument("--latency-s", type=float, default=6.0,
                    help="mean wall seconds an env step waits (std a quarter of it); 3 turns an episode")
    ap.add_argument("--rollouts", type=int, default=8, help="simulated rollouts (one process hosts them all)")
    ap.add_argument("--slots", type=int, default=128, help="sequences each simulated rollout decodes at once")
    ap.add_argument("--engine-time-scale", type=float, default=0.5,
                    help="wall seconds per model second of the sim rollouts")
    ap.add_argument("--duration-s", type=float, default=80.0, help="wall seconds per run")
    ap.add_argument("--warmup-s", type=float, default=35.0,
                    help="from the first scrape of the env-host: the window starts after it")
    ap.add_argument("--repeat", type=int, default=1, help="runs per N (a stable figure repeats)")
    ap.add_argument("--label", default="", help="a name for these runs in the JSON and the plot (e.g. before/after)")
    ap.add_argument("--append", action="store_true", help="add to the records already in --json")
    ap.add_argument("--profile", type=Path, default=None, help="cProfile the env loop into this folder")
    ap.add_argument("--json", type=Path, default=Path("runs/bench/env_scale.json"))
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.managers.split(",") if x.strip()]
    records: list[dict[str, Any]] = []
    made_by = provenance("rlfleet.tools.bench.env_scale", argv)  # before the runs: the code they start from
    if args.append and args.json.exists():
        records = json.loads(args.json.read_text()).get("records", [])
    for n in sizes:
        for rep in range(args.repeat):
            spec = spec_for(n, args.latency_s, args.rollouts, args.slots, args.engine_time_scale)
            profile = args.profile / f"env-host-{n}-{rep}.prof" if args.profile else None
            if profile is not None:
                profile.parent.mkdir(parents=True, exist_ok=True)
            started = time.monotonic()
            try:
                run_dir, lines, scraper, code = run_once(spec, args.duration_s, profile)
            finally:
                spec.unlink(missing_ok=True)
            r = measure(n, run_dir, lines, scraper, code, args.warmup_s, args.latency_s)
            r["label"] = args.label
            records.append(r)
            print(f"{n:>5} managers{' ' + args.label if args.label else ''}: in flight {r.get('in_flight_mean')}, "
                  f"{r.get('trajectories_per_s')} traj/s, {r.get('cpu_s_per_1000')} CPU s/1000 traj, "
                  f"lag p50/p99/max {r.get('loop_lag_p50_s')}/{r.get('loop_lag_p99_s')}/{r.get('loop_lag_max_s')} s, "
                  f"sim lag {r['sim_max_lag']}{'' if r['valid'] else '  INVALID: ' + r['invalid_because']} "
                  f"({time.monotonic() - started:.0f} s, {run_dir})", flush=True)
            if profile is not None:
                print_profile(profile)
            write_json(args.json, {**made_by, "base": str(BASE), "duration_s": args.duration_s,
                                   "warmup_s": args.warmup_s, "records": records})
    print()
    print(table(records))
    return finish(records, args.json, args.plot, plot)


if __name__ == "__main__":
    sys.exit(main())
