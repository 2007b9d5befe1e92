"""The device check: every GPU measurement of the real-scale work in one run, under 8 minutes
on a machine with one GPU and 16 cores (python -m rlfleet.tools.bench.gpu --json OUT.json).

A GPU machine is lent for minutes and starts slowly, so this is one prepared script: each
part below runs in order, is timed, and records either its figures or why it could not run
(an exception's text, or "not built"), so one failing part never costs the others. The
record carries the machine (nvidia-smi's GPU, torch and CUDA versions) with the provenance
of tools/bench/output.py.

Parts:
- ``shape``: the Qwen2-0.5B shape (tools/model_shapes.py), random weights in bfloat16.
- ``engine``: the torch rollout engine on the GPU, bfloat16: generated tokens/s with 1, 8,
  32 and 128 requests in flight (prompts of --prompt-len random tokens, --new-tokens each,
  EOS ignored: every request does the same work).
- ``vllm``: the same with the vLLM engine where ``import vllm`` works in this Python; else
  the import error (the CUDA vLLM wheel is several GB: a machine without it says so).
- ``train_step``: one training step of the torch trainer on the GPU on that shape, float32
  master weights (GRPO groups of tools/bench/megatron_check.py's make_batch), then the
  published copy in bfloat16: the trainer's stall for it and its bytes (half of float32's).
- ``megatron_step``: one megatron learner step on that shape on the GPU in bfloat16
  (megatron's mixed precision: float32 master weights and Adam state), one rank; its time
  after a warm-up step, the GPU's peak memory, and its published bfloat16 bytes. Several
  GPUs (tensor parallel) need more than this one-GPU machine: docs/results/scale.md has TP 2
  on the CPU.
- ``load``: the published version through the relay's manifest and byte range (no network
  hop: the relay chain's throughput is tools/bench/relay's) into the GPU engine:
  build_manifest with its chunk checksums, then load_weights, each timed.
- ``job``: a short whole job (`rlfleet run` of the arithmetic example, the tiny model, its
  rollout on the GPU through `[placement] gpus`) that learns: held-out success at the start
  and the end. Needs etcd on PATH.

``--dry`` runs every part on the CPU with small shapes (a 2-layer shape, fewer requests and
tokens, a job of a few steps): what CI runs (tests/tools/bench/test_gpu_check.py), so the
script is known to work before the minutes on a GPU are spent.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CONCURRENCY = (1, 8, 32, 128)
DRY_CONCURRENCY = (1, 2)


def _part(record: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    """Run one part into record[name]: its figures and seconds, or the error that stopped it."""
    started = time.monotonic()
    print(f"[gpu check] {name} ...", flush=True)
    try:
        out = {"ok": True, **fn()}
    except Exception as exc:  # noqa: BLE001 — a part that fails is recorded, the next one runs
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=4)}
    out["seconds"] = round(time.monotonic() - started, 2)
    record[name] = out
    print(f"[gpu check] {name}: {'ok' if out['ok'] else out['error']} ({out['seconds']} s)", flush=True)


def gpu_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    gpus=torch.cuda.device_count())
    return info


def build_shape(out: Path, dry: bool) -> dict[str, Any]:
    from rlfleet.tools import model_shapes

    overrides = {"num_hidden_layers": 2, "vocab_size": 512} if dry else {}
    shape = "qwen2-100m" if dry else "qwen2-0.5b"
    model_shapes.write_shape(shape, out, dtype="bfloat16", seed=0, **overrides)
    written = json.loads((out / model_shapes.SHAPE_FILE).read_text())
    return {"shape": shape, "overrides": overrides, "model_params": written["params"]}


def engine_tokens_per_s(model_dir: Path, device: str, concurrency: tuple[int, ...], prompt_len: int,
                        new_tokens: int) -> dict[str, Any]:
    import torch

    from rlfleet.daemons.rollout.engines.torch_engine import TorchEngine
    from rlfleet.tools.bench.rollout_engine import _prompts, generate_all

    # No EOS: every request generates new_tokens, the same work at each concurrency.
    engine = TorchEngine.from_pretrained(model_dir, max_batch=max(concurrency), max_len=prompt_len + new_tokens,
                                         seed=0, dtype="bfloat16", device=device, eos_token_ids=set())
    generate_all(engine, _prompts(1, prompt_len, engine.vocab_size, 1, seed=99), 2)  # warm-up
    out = {}
    for c in concurrency:
        prompts = _prompts(c, prompt_len, engine.vocab_size, 1, seed=c)
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        tokens = generate_all(engine, prompts, new_tokens)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        out[str(c)] = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1)}
    return {"device": device, "dtype": "bfloat16", "prompt_len": prompt_len, "new_tokens": new_tokens,
            "by_concurrency": out}


def vllm_tokens_per_s(model_dir: Path, concurrency: tuple[int, ...], prompt_len: int,
                      new_tokens: int) -> dict[str, Any]:
    try:
        import vllm
    except Exception as exc:  # noqa: BLE001 — not installed, or a broken build: say which
        return {"available": False, "why": f"import vllm: {type(exc).__name__}: {exc}"}
    from vllm import LLM, SamplingParams

    from rlfleet.tools.bench.rollout_engine import _prompts

    llm = LLM(model=str(model_dir), dtype="bfloat16", seed=0, max_model_len=prompt_len + new_tokens)
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, temperature=1.0)
    out = {}
    for c in concurrency:
        prompts = [{"prompt_token_ids": p} for p in _prompts(c, prompt_len, 512, 1, seed=c)]
        started = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        tokens = sum(len(r.outputs[0].token_ids) for r in results)
        out[str(c)] = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1)}
    return {"available": True, "vllm": vllm.__version__, "by_concurrency": out}


def train_step_and_publish(model_dir: Path, device: str, groups: int, group_size: int) -> dict[str, Any]:
    import resource

    import torch

    from rlfleet.daemons.trainer.learner import Learner
    from rlfleet.tools.bench.megatron_check import make_batch

    learner = Learner(model_dir, seed=0, device=device)
    batch = make_batch(learner.vocab_size, groups, group_size, seed=0)
    learner.train_step(batch)  # warm-up: the first step allocates the optimizer state
    started = time.perf_counter()
    stats = learner.train_step(batch)
    step_s = time.perf_counter() - started
    published: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16"):
        started = time.perf_counter()
        tensors = learner.state_tensors(dtype)
        published[dtype] = {"copy_s": round(time.perf_counter() - started, 3),
                            "bytes": sum(a.nbytes for a in {id(a): a for a in tensors.values()}.values())}
    peak_gpu = round(torch.cuda.max_memory_allocated() / 2**20) if device == "cuda" else None
    return {"backend": "torch", "device": device, "train_dtype": "float32", "groups": groups,
            "group_size": group_size, "step_s": round(step_s, 3), "loss": stats["loss"],
            "published": published, "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "peak_gpu_mib": peak_gpu,
            "tensors": tensors}


def megatron_step(model_dir: Path, device: str, groups: int, group_size: int) -> dict[str, Any]:
    """One megatron learner step in bfloat16 (one rank) on ``device``."""
    import torch

    from rlfleet.daemons.trainer.megatron.learner import MegatronLearner, release_parallel_state
    from rlfleet.tools.bench.megatron_check import make_batch

    learner = MegatronLearner(model_dir, seed=0, device=device, precision="bfloat16")
    try:
        batch = make_batch(learner.vocab_size, groups, group_size, seed=0)
        learner.train_step(batch)  # warm-up: allocates the optimizer state
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        stats = learner.train_step(batch)
        step_s = time.perf_counter() - started
        published = learner.state_tensors("bfloat16")
        peak_gpu = round(torch.cuda.max_memory_allocated() / 2**20) if device == "cuda" else None
        return {"backend": "megatron", "precision": "bfloat16", "device": device, "groups": groups,
                "group_size": group_size, "step_s": round(step_s, 3), "loss": stats["loss"],
                "tokens": stats["tokens"], "peak_gpu_mib": peak_gpu,
                "published_bytes": sum(a.nbytes for a in {id(a): a for a in published.values()}.values())}
    finally:
        learner.gpt = learner.ddp = learner.optimizer = None
        release_parallel_state()


def relay_load(model_dir: Path, device: str, tensors: dict[str, Any]) -> dict[str, Any]:
    import torch

    from rlfleet.daemons.rollout.engines.torch_engine import TorchEngine
    from rlfleet.relay.manifest import build_manifest, tensor_views

    engine = TorchEngine.from_pretrained(model_dir, max_batch=8, max_len=256, seed=0, dtype="bfloat16",
                                         device=device)
    started = time.perf_counter()
    manifest, source = build_manifest(1, tensors, chunk_bytes=32 << 20)
    manifest_s = time.perf_counter() - started
    views = tensor_views(manifest, source.to_bytearray())  # the byte range a relay stores in shared memory
    started = time.perf_counter()
    engine.load_weights(1, views)
    if device == "cuda":
        torch.cuda.synchronize()
    load_s = time.perf_counter() - started
    return {"total_bytes": manifest.total_bytes, "chunks": manifest.n_chunks, "manifest_s": round(manifest_s, 3),
            "load_s": round(load_s, 3), "device": device}


def short_job(workdir: Path, dry: bool) -> dict[str, Any]:
    """`rlfleet run` of the arithmetic example on the tiny model, its rollout on the GPU
    (`gpus_per_daemon = { rollout = 1 }`; the trainer on the CPU: one GPU gives one daemon),
    until --steps; the held-out success at the first and the last evaluation."""
    from rlfleet.tools.bench.spec_variants import write_variant
    from rlfleet.tools.exit_codes import RUN_ENDED

    if shutil.which("etcd") is None:
        return {"ran": False, "why": "no etcd on PATH"}
    steps = 4 if dry else 120

    def change(spec: dict[str, Any]) -> None:
        spec["job"]["name"] = "gpu-check"
        spec["job"]["runs_dir"] = str(workdir / "runs")  # with the check's other files, not in the tree
        spec["trainer"]["max_steps"] = steps
        spec["task"]["eval_every_steps"] = steps
        spec["task"]["eval_size"] = 16 if dry else 128
        if not dry:
            host = spec["placement"]["hosts"][0]
            host["gpus"], host["gpus_per_daemon"] = 1, {"rollout": 1}
    variant = write_variant(REPO / "examples" / "arithmetic.toml", "gpu-check", change)
    try:
        proc = subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "run", str(variant), "--no-view",
                               "--insecure", "--duration", "150" if dry else "240"],
                              capture_output=True, text=True, timeout=300)
    finally:
        variant.unlink(missing_ok=True)
    run_dir = next((line.split("run dir:", 1)[1].strip() for line in proc.stdout.splitlines()
                    if line.startswith("run dir:")), None)
    summary_path = Path(run_dir) / "summary.json" if run_dir else None
    if proc.returncode not in RUN_ENDED or summary_path is None or not summary_path.exists():
        raise RuntimeError(f"rlfleet run ended {proc.returncode}: {proc.stdout[-1500:]} {proc.stderr[-1500:]}")
    s = json.loads(summary_path.read_text())
    return {"ran": True, "exit": proc.returncode, "steps": steps, "rollout_on_gpu": not dry,
            "eval_success_first": s.get("eval_success_first"), "eval_success_last": s.get("eval_success_last"),
            "run_dir": run_dir}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, required=True, help="write the record here")
    p.add_argument("--dry", action="store_true", help="every part on the CPU with small shapes (CI)")
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--skip", action="append", default=[],
                   choices=("engine", "vllm", "train_step", "megatron_step", "load", "job"),
                   help="leave a part out (repeatable)")
    args = p.parse_args(argv)
    from rlfleet.tools.bench.output import provenance, write_json

    dry = args.dry
    prompt_len = args.prompt_len or (8 if dry else 128)
    new_tokens = args.new_tokens or (4 if dry else 64)
    concurrency = DRY_CONCURRENCY if dry else CONCURRENCY
    record: dict[str, Any] = {**provenance("rlfleet.tools.bench.gpu", argv), "dry": dry, "gpu": gpu_info()}
    device = "cpu" if dry else "cuda"
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rlfleet-gpu-check-") as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        _part(record, "shape", lambda: build_shape(model_dir, dry))
        built = record["shape"]["ok"]
        if "engine" not in args.skip and built:
            _part(record, "engine", lambda: engine_tokens_per_s(model_dir, device, concurrency, prompt_len, new_tokens))
        if "vllm" not in args.skip and built:
            _part(record, "vllm", lambda: vllm_tokens_per_s(model_dir, concurrency, prompt_len, new_tokens))
        held: dict[str, Any] = {}
        if "train_step" not in args.skip and built:
            def step() -> dict[str, Any]:
                out = train_step_and_publish(model_dir, device, groups=2 if dry else 8, group_size=2 if dry else 8)
                held["tensors"] = out.pop("tensors")
                return out
            _part(record, "train_step", step)
        if "megatron_step" not in args.skip and built:
            _part(record, "megatron_step",
                  lambda: megatron_step(model_dir, device, groups=2 if dry else 8, group_size=2 if dry else 8))
        if "load" not in args.skip and "tensors" in held:
            _part(record, "load", lambda: relay_load(model_dir, device, held.pop("tensors")))
        if "job" not in args.skip:
            _part(record, "job", lambda: short_job(work, dry))
    record["total_s"] = round(time.monotonic() - started, 1)
    write_json(args.json, record)
    failed = [name for name, part in record.items() if isinstance(part, dict) and part.get("ok") is False]
    print(f"[gpu check] {record['total_s']} s; wrote {args.json}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
