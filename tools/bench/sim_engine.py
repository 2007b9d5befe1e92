"""CPU cost of the sim rollout engine: many engines in one process, kept saturated.

    python -m rlfleet.tools.bench.sim_engine --engines 64,1000 --duration-s 60 --json OUT.json

Each engine (profile ``--profile``, lognormal lengths ``--median``/``--p99`` capped at
``--max-new``) is kept at ``--in-flight`` requests (running + waiting): GRPO groups of
``--group`` requests sharing a ``--prompt-len``-token prompt, and each finished request
is replaced at once. One thread drives all engines as a host loop would: sleep until the
earliest ``next_event_at()``, ``step()`` the engines that are due, add the replacements.

Reported per engine count, over the ``--duration-s`` after ``--warmup-s``: CPU seconds
(this process) per wall second, results and simulated tokens per wall second, CPU
microseconds per result (its replacement's add() included: the cost scales with
results/s = engines x running / request latency, not with tokens), mean
running requests per engine, and the engines' lag (sum of lateness / sum of modelled
latency, over the results delivered in the window; max lateness). A run whose lag is
above 5% is reported ``valid: false``: the process could not keep up with its timing model.
"""

from __future__ import annotations

import argparse
import heapq
import json
import time

import numpy as np

from rlfleet.common.wire.arrays import Int32Array
from rlfleet.common.wire.messages import GenerateRequest
from rlfleet.daemons.rollout.sim.engine import SimEngine
from rlfleet.daemons.rollout.sim.lengths import Lognormal
from rlfleet.daemons.rollout.sim.timing import PROFILES
from rlfleet.tools.options import add_options

MAX_LAG = 0.05
VOCAB, EOS = 152064, 151643  # Qwen2.5's vocabulary and <|endoftext|>


class Fleet:
    def __init__(self, n: int, a: argparse.Namespace) -> None:
        timing = PROFILES[a.profile].timing
        lengths = Lognormal(a.median, a.p99, a.group_correlation)
        self.engines = [SimEngine(timing, lengths, vocab_size=VOCAB, eos_token_id=EOS, seed=a.seed,
                                  time_scale=a.time_scale) for _ in range(n)]
        rng = np.random.default_rng(a.seed)
        self.prompts = [Int32Array(rng.integers(0, VOCAB, a.prompt_len, dtype=np.int32))
                        for _ in range(4096)]
        self.a, self.next_id, self.in_flight = a, 0, [0] * n
        self.heap: list[tuple[float, int]] = []
        self.scheduled = [float("inf")] * n

    def fill(self, i: int) -> None:
        """Top engine i up to --in-flight requests, a GRPO group at a time."""
        e, a = self.engines[i], self.a
        while self.in_flight[i] + a.group <= a.in_flight:
            prompt = self.prompts[self.next_id % len(self.prompts)]
            for m in range(a.group):
                rid = f"{self.next_id}-{m}"
                e.add(GenerateRequest(rid, rid, prompt, a.max_new, 1.0, 1.0))
            self.next_id += 1
            self.in_flight[i] += a.group

    def schedule(self, i: int) -> None:
        t = self.engines[i].next_event_at()
        if t is not None and t != self.scheduled[i]:
            self.scheduled[i] = t
            heapq.heappush(self.heap, (t, i))

    def run_until(self, end: float) -> int:
        """Drive every engine until wall time `end`; the number of step() calls."""
        steps = 0
        while True:
            now = time.monotonic()
            if now >= end:
                return steps
            if not self.heap or self.heap[0][0] > now:
                time.sleep(min(end, self.heap[0][0] if self.heap else end) - now)
                continue
            t, i = heapq.heappop(self.heap)
            if t != self.scheduled[i]:
                continue  # superseded
            self.scheduled[i] = float("inf")
            self.in_flight[i] -= len(self.engines[i].step())
            steps += 1
            self.fill(i)
            self.schedule(i)


def bench(n: int, a: argparse.Namespace) -> dict:
    fleet = Fleet(n, a)
    for i in range(n):
        fleet.fill(i)
        fleet.schedule(i)
    fleet.run_until(time.monotonic() + a.warmup_s)
    es = fleet.engines
    late0, lat0 = sum(e.late_s for e in es), sum(e.latency_s for e in es)
    res0, gen0 = sum(e.results_delivered for e in es), sum(e.generated_tokens for e in es)
    for e in es:
        e.max_late_s = 0.0
    wall0, cpu0 = time.monotonic(), time.process_time()
    steps = fleet.run_until(wall0 + a.duration_s)
    wall, cpu = time.monotonic() - wall0, time.process_time() - cpu0
    late, lat = sum(e.late_s for e in es) - late0, sum(e.latency_s for e in es) - lat0
    lag = late / lat if lat > 0 else 0.0
    stats = [e.stats() for e in es]
    results = sum(e.results_delivered for e in es) - res0
    return {
        "engines": n, "profile": a.profile, "time_scale": a.time_scale, "in_flight": a.in_flight,
        "wall_s": round(wall, 2), "cpu_s_per_wall_s": round(cpu / wall, 3),
        "results_per_s": round(results / wall, 1),
        "cpu_us_per_result": round(cpu / max(results, 1) * 1e6, 1),  # its add() included
        "sim_tokens_per_s": round((sum(e.generated_tokens for e in es) - gen0) / wall),
        "steps_per_s": round(steps / wall, 1),
        "running_mean": round(sum(s.running for s in stats) / n, 1),
        "kv_used_mean": round(sum(s.kv_used / s.kv_total for s in stats) / n, 3),
        "lag_fraction": round(lag, 5), "max_late_s": round(max(e.max_late_s for e in es), 4),
        "valid": lag <= MAX_LAG,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="64,1000", help="comma-separated engine counts")
    ap.add_argument("--profile", default="h800-7b", choices=sorted(PROFILES))
    add_options(ap, time_scale=(1.0, "wall seconds per model second"),
                in_flight=(320, "requests per engine (running + waiting)"), group=8, prompt_len=512, max_new=16384,
                median=2048.0, p99=12288.0, group_correlation=0.5, seed=0, warmup_s=20.0, duration_s=30.0)
    ap.add_argument("--json", help="write the records to this file")
    a = ap.parse_args(argv)
    records = []
    for n in (int(x) for x in a.engines.split(",")):
        rec = bench(n, a)
        print(json.dumps(rec), flush=True)
        records.append(rec)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0 if all(r["valid"] for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
