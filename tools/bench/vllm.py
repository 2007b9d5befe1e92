"""The vLLM rollout engine against the torch engine on the shipped model.

    .venv-vllm/bin/python -m rlfleet.tools.bench.vllm --model models/tiny-qwen2 \\
        --out runs/bench/vllm [--repeats 3]

Runs in .venv-vllm (`make setup-vllm`): both engines are importable there.

- Tokens/s: ``batch`` requests of ``--prompt-len`` random digit tokens, exactly
  ``--new-tokens`` sampled at temperature 1 (EOS off in both engines, so both do the same
  work), added at once and stepped to the end; prefill included. Engines take turns in
  each of ``--repeats`` rounds; reported: each one's best round.
- Time to load a version: ``load_weights`` of a full HF state dict (numpy arrays, as the
  relay's shared-memory views arrive) between requests; median of ``--loads``.
- Log-prob mismatch against the trainer: ``--groups`` arithmetic prompts x 8 samples
  from each engine at temperature 1, every token's log-prob recomputed as the trainer
  does (the HF model's full forward, float32); per token, the ratio trainer / engine.
  Reported: mean and max |log-prob difference|, and the ratio's spread without TIS and
  with it (TIS weight min(ratio, C), C = the `tis` loss's default cap 2). ``--dtype
  bfloat16`` runs vLLM in bfloat16 against the float32 trainer, the usual GPU set-up.

Writes DIR/vllm.json and DIR/vllm.png (tokens/s per batch for both engines).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from rlfleet.common.wire.arrays import Int32Array
from rlfleet.common.wire.messages import GenerateRequest

TIS_CAP = 2.0  # daemons/trainer/losses.py, TISConfig.cap's default


def _requests(n: int, prompt_len: int, new: int, seed: int, vocab: dict[str, int],
              temperature: float = 1.0) -> list[GenerateRequest]:
    rng = random.Random(seed)
    digits = [vocab[str(d)] for d in range(10)]
    return [GenerateRequest(request_id=f"r{i}", trajectory_id="t",
                            prompt_token_ids=Int32Array([rng.choice(digits) for _ in range(prompt_len)]),
                            max_new_tokens=new, temperature=temperature, top_p=1.0, seed=seed * 1000 + i)
            for i in range(n)]


def _drain(engine: Any) -> dict[str, Any]:
    out = {}
    while engine.has_work():
        for r in engine.step():
            out[r.request_id] = r
    return out


def tokens_per_s(engines: dict[str, Any], batches: list[int], prompt_len: int, new: int,
                 repeats: int, vocab: dict[str, int]) -> dict[str, dict[int, float]]:
    best: dict[str, dict[int, float]] = {name: {} for name in engines}
    for b in batches:
        for rnd in range(repeats):
            for name, engine in engines.items():
                reqs = _requests(b, prompt_len, new, rnd, vocab)
                started = time.perf_counter()
                for r in reqs:
                    engine.add(r)
                out = _drain(engine)
                wall = time.perf_counter() - started
                made = sum(len(r.token_ids) for r in out.values())
                assert made == b * new, (name, made, b * new)
                best[name][b] = max(best[name].get(b, 0.0), made / wall)
    return best


def load_seconds(engine: Any, tensors: dict[str, np.ndarray], loads: int) -> float:
    times = []
    for _ in range(loads):
        started = time.perf_counter()
        engine.load_weights(engine.weight_version + 1, tensors)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def mismatch(engine: Any, model: Any, groups: int, vocab: dict[str, int], seed: int) -> dict[str, float]:
    import torch

    rng = random.Random(seed)
    reqs = []
    for g in range(groups):
        text = f"{rng.randrange(10, 100)}+{rng.randrange(10, 100)}="
        for k in range(8):
            reqs.append(GenerateRequest(request_id=f"g{g}-{k}", trajectory_id="t",
                                        prompt_token_ids=Int32Array([vocab[c] for c in text]),
                                        max_new_tokens=8, temperature=1.0, top_p=1.0, seed=g * 8 + k))
    for r in reqs:
        engine.add(r)
    out = _drain(engine)
    diffs = []
    for r in reqs:
        prompt, toks = r.prompt_token_ids.tolist(), out[r.request_id].token_ids.tolist()
        with torch.inference_mode():
            logp = torch.log_softmax(model(torch.tensor([prompt + toks])).logits[0].float(), -1)
        pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(toks))
        trainer = logp[pos, torch.tensor(toks)].double().numpy()
        diffs.append(trainer - out[r.request_id].logprobs.numpy().astype(np.float64))
    d = np.concatenate(diffs)
    ratio = np.exp(d)
    tis = np.minimum(ratio, TIS_CAP)
    return {"tokens": int(d.size), "mean_abs_logprob_diff": float(np.abs(d).mean()),
            "max_abs_logprob_diff": float(np.abs(d).max()),
            "ratio_mean": float(ratio.mean()), "ratio_max": float(ratio.max()),
            "ratio_abs_dev_mean": float(np.abs(ratio - 1).mean()),
            "tis_weight_mean": float(tis.mean()), "tis_abs_dev_mean": float(np.abs(tis - 1).mean()),
            "tis_capped_fraction": float((ratio > TIS_CAP).mean())}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, per_batch in result["tokens_per_s"].items():
        bs = sorted(int(b) for b in per_batch)
        ax.plot(bs, [per_batch[str(b)] if str(b) in per_batch else per_batch[b] for b in bs], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("generated tokens/s (best round)")
    ax.set_title(f"{result['model']}: {result['new_tokens']} tokens/request, 2 cores")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("models/tiny-qwen2"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loads", type=int, default=5)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="vLLM's dtype (the torch engine and the trainer stay float32)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/vllm"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from rlfleet.daemons.rollout.engines.torch_engine import TorchEngine
    from rlfleet.daemons.rollout.engines.vllm_engine import VllmEngine

    torch.set_num_threads(1)  # as the rollout daemon on this machine (1 torch thread)
    vocab = json.loads((args.model / "tokenizer.json").read_text())["model"]["vocab"]
    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.prompt_len + args.new_tokens
    started = time.perf_counter()
    vllm = VllmEngine.from_pretrained(args.model, max_batch=max(batches), max_len=max(max_len, 256),
                                      dtype=args.dtype)
    vllm_start_s = time.perf_counter() - started
    started = time.perf_counter()
    torch_engine = TorchEngine.from_pretrained(args.model, max_batch=max(batches))
    torch_start_s = time.perf_counter() - started
    engines = {"vllm" if args.dtype == "float32" else f"vllm-{args.dtype}": vllm, "torch": torch_engine}
    # EOS off: every request makes exactly --new-tokens tokens (vLLM also stops on the
    # model's EOS by itself, hence ignore_eos besides no stop_token_ids)
    eos, sampling = torch_engine.eos, vllm._sampling
    torch_engine.eos = vllm.eos = set()
    vllm._sampling = functools.partial(sampling, ignore_eos=True)
    tps = tokens_per_s(engines, batches, args.prompt_len, args.new_tokens, args.repeats, vocab)
    torch_engine.eos, vllm.eos, vllm._sampling = eos, set(eos), sampling
    tensors = load_file(str(args.model / "model.safetensors"))
    loads = {name: load_seconds(e, tensors, args.loads) for name, e in engines.items()}
    trainer = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32).eval()
    mis = {name: mismatch(e, trainer, args.groups, vocab, seed=1) for name, e in engines.items()}
    import vllm as vllm_pkg

    result = {"model": str(args.model), "vllm": vllm_pkg.__version__, "torch": torch.__version__,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "start_s": {"vllm": round(vllm_start_s, 1), "torch": round(torch_start_s, 1)},
              "tokens_per_s": {n: {str(b): round(v, 1) for b, v in d.items()} for n, d in tps.items()},
              "load_version_s": {n: round(v, 4) for n, v in loads.items()},
              "logprob_mismatch": mis}
    (args.out / "vllm.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "vllm.png")
    print(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'vllm.json'} and {args.out / 'vllm.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
