"""The real-scale path on this machine: the Qwen2-0.5B shape through a multi-rank megatron
trainer, one publication and one rollout load (issue 31's scale target):

    python -m rlfleet.tools.bench.scale --json tools/bench/results/scale_qwen2-0.5b_tp2.json [--runs 3]

Per run (a fresh set of processes each):
- the trainer: ``tensor_parallel`` x ``data_parallel`` ranks of the megatron learner on
  the CPU (gloo), started by torchrun (tools/bench/scale_rank.py; the trainer daemon does
  not form such a group yet), float32 training by default; two steps on one batch of
  GRPO groups (tools/bench/megatron_check.make_batch): ``first_step_s`` allocates the
  optimizer state, ``step_s`` is the second;
- publication: every rank publishes its own tensor-parallel slice (no rank gathers the
  model): the HF-named copy in float32 and in bfloat16 through the relay's manifest and
  byte range, timed (``publish_s``) with its bytes;
- the rollout load: the bfloat16 slices put together (weights.hf_join: what a relay
  holding every rank's slice serves) into the torch rollout engine on the CPU, bfloat16,
  ``load_weights`` timed (``load_s``), then one request generated on the new weights;
- ``peak_rss_mib`` per rank (ru_maxrss) and the engine process's.

The shape is built once (tools/model_shapes.py, float32, random weights). ``--dry`` runs
the same on a 2-layer qwen2-100m with a 512-token vocabulary, one run (CI:
tests/tools/bench/test_scale.py). Where this differs from a GPU cluster: CPU arithmetic,
gloo over loopback, and all ranks on one 2-core machine, so the seconds are this
machine's; the bytes, the memory per rank and the completion of each stage are the point.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run_ranks(model: Path, out: Path, tensor: int, data: int, precision: str, groups: int, size: int,
              timeout_s: float) -> list[dict[str, Any]]:
    out.mkdir(parents=True)
    world = tensor * data
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world))}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
         "-m", "rlfleet.tools.bench.scale_rank", str(model), str(out), str(tensor), str(data), precision,
         str(groups), str(size)],
        env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"the trainer ranks failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def rollout_load(model: Path, out: Path, tensor: int) -> dict[str, Any]:
    """The bfloat16 slices joined into the torch rollout engine; one request on them."""
    import torch
    from safetensors.torch import load_file

    from rlfleet.common.tensors import to_numpy
    from rlfleet.daemons.rollout.engines.torch_engine import TorchEngine
    from rlfleet.daemons.trainer.megatron import weights as mw
    from rlfleet.relay.manifest import build_manifest, tensor_views
    from rlfleet.tools.bench.rollout_engine import _prompts, generate_all

    engine = TorchEngine.from_pretrained(model, max_batch=1, max_len=64, seed=0, dtype="bfloat16", device="cpu")
    slices = [load_file(str(out / f"slice-{t}.safetensors")) for t in range(tensor)]
    started = time.perf_counter()
    whole = {n: to_numpy(t, "bfloat16") for n, t in mw.hf_join(slices).items()}
    join_s = time.perf_counter() - started
    manifest, source = build_manifest(2, whole, chunk_bytes=32 << 20)
    views = tensor_views(manifest, source.to_bytearray())
    started = time.perf_counter()
    engine.load_weights(2, views)
    load_s = time.perf_counter() - started
    with torch.no_grad():
        tokens = generate_all(engine, _prompts(1, 8, engine.vocab_size, 1, seed=1), 4)
    return {"join_s": round(join_s, 3), "load_s": round(load_s, 3), "bytes": manifest.total_bytes,
            "generated_tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, required=True, help="write the record here (its name should contain 'scale')")
    p.add_argument("--shape", default="qwen2-0.5b")
    p.add_argument("--tensor-parallel", type=int, default=2)
    p.add_argument("--data-parallel", type=int, default=1)
    p.add_argument("--precision", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--groups", type=int, default=2, help="GRPO groups in the batch")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dry", action="store_true", help="a 2-layer qwen2-100m, one run (CI)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per run's trainer ranks")
    args = p.parse_args(argv)
    from rlfleet.tools import model_shapes
    from rlfleet.tools.bench.output import provenance, write_json

    shape, overrides = (("qwen2-100m", {"num_hidden_layers": 2, "vocab_size": 512}) if args.dry
                        else (args.shape, {}))
    runs_wanted = 1 if args.dry else args.runs
    record: dict[str, Any] = {**provenance("rlfleet.tools.bench.scale", argv), "dry": args.dry,
                              "shape": shape, "overrides": overrides, "tensor_parallel": args.tensor_parallel,
                              "data_parallel": args.data_parallel, "precision": args.precision,
                              "groups": args.groups, "group_size": args.group_size, "runs": []}
    with tempfile.TemporaryDirectory(prefix="rlfleet-scale-") as tmp:
        model = Path(tmp) / "model"
        started = time.perf_counter()
        built = model_shapes.write_shape(shape, model, dtype="float32", seed=0, **overrides)
        record["model_params"] = built["params"]
        record["shape_build_s"] = round(time.perf_counter() - started, 1)
        print(f"[scale] {shape}: {built['params']:,} parameters, TP {args.tensor_parallel} x DP "
              f"{args.data_parallel}, {args.precision}", flush=True)
        for n in range(runs_wanted):
            out = Path(tmp) / f"run-{n}"
            started = time.perf_counter()
            run: dict[str, Any] = {"run": n}
            try:
                run["ranks"] = run_ranks(model, out, args.tensor_parallel, args.data_parallel, args.precision,
                                         args.groups, args.group_size, args.timeout_s)
                run["rollout"] = rollout_load(model, out, args.tensor_parallel)
                run["ok"] = True
            except Exception as exc:  # noqa: BLE001 — a void run is kept with its reason
                run["ok"], run["error"] = False, f"{type(exc).__name__}: {exc}"
            run["wall_s"] = round(time.perf_counter() - started, 1)
            record["runs"].append(run)
            summary = (f"step {max(r['step_s'] for r in run['ranks'])} s, load {run['rollout']['load_s']} s"
                       if run["ok"] else run["error"][:300])
            print(f"[scale] run {n + 1}/{runs_wanted}: {summary}", flush=True)
            for f in out.glob("slice-*.safetensors"):
                f.unlink()  # a GiB each at the 0.5B shape
    record["engine_peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    record.update(summarise(record["runs"]))
    write_json(args.json, record)
    print(f"[scale] wrote {args.json}", flush=True)
    return 0 if record["runs"] and all(r["ok"] for r in record["runs"]) else 1


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures the issue asks for, as medians over the runs that completed (every run
    stays in ``runs``): a step's time is its slowest rank's, publication likewise."""
    ok = [r for r in runs if r["ok"]]
    if not ok:
        return {"runs_ok": 0}

    def median(values: list[float]) -> float:
        return round(statistics.median(values), 3)

    ranks = len(ok[0]["ranks"])
    return {
        "runs_ok": len(ok),
        "step_s": median([max(r["step_s"] for r in run["ranks"]) for run in ok]),
        "first_step_s": median([max(r["first_step_s"] for r in run["ranks"]) for run in ok]),
        "publish_s": {d: median([max(r["published"][d]["publish_s"] for r in run["ranks"]) for run in ok])
                      for d in ("float32", "bfloat16")},
        # one copy of each tensor-parallel slice (data-parallel replicas publish the same)
        "published_bytes": {d: sum(r["published"][d]["bytes"] for r in ok[0]["ranks"] if r["dp_rank"] == 0)
                            for d in ("float32", "bfloat16")},
        "load_s": median([run["rollout"]["load_s"] for run in ok]),
        "peak_rss_mib": [max(run["ranks"][k]["peak_rss_mib"] for run in ok) for k in range(ranks)],
    }


if __name__ == "__main__":
    sys.exit(main())
