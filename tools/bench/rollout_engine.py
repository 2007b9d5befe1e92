"""Tokens/s of the rollout `torch` engine vs plain `generate` vs transformers' continuous batching.

    python -m rlfleet.tools.bench.rollout_engine --model models/tiny-qwen2 --json bench.json

Each contender generates exactly ``--new-tokens`` tokens for each of ``batch`` prompts of
``--prompt-len`` random tokens, sampling at temperature 1 (EOS ignored, so every
contender does the same work). Time includes prefill. Contenders take turns in each of
``--repeats`` rounds; reported: each one's best round.

Contenders: ``engine`` (rlfleet's TorchEngine), ``generate`` (one model.generate call per
batch: no joining or aborting between steps), ``generate_batch`` (transformers' continuous
batching as one call, set-up included) and ``cb_manager`` (transformers' continuous
batching manager started once and reused: its steady state).

``--fleet ROUNDS`` measures instead what the arithmetic fleet asks of a rollout: per round
(one training step's worth) ``--fleet-batch`` single-turn requests with prompts like
"37+85=" (tokenized by the model's tokenizer; ``--group`` requests share each prompt, as
a GRPO group does), 5 new tokens at most, EOS on, arriving
at random over ``--arrival-ms``; the engine is driven as the daemon's loop drives it
(add what has arrived, step while there is work). Reported: CPU seconds per 1000
rounds, CPU microseconds per generated token (``--step-ms``: steps on a virtual clock, so the
batching does not depend on how fast this machine is right now), forward calls per round, and a digest
of the generated tokens (every request is seeded, so it must not change with the
batching; ``--dump`` writes tokens and log-probs for a closer comparison).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlfleet.common.wire.arrays import Int32Array
from rlfleet.common.wire.messages import GenerateRequest
from rlfleet.daemons.rollout.engines.torch_engine import TorchEngine


def _prompts(batch: int, length: int, vocab: int, bos: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    low = min(4, vocab - 1)  # skip the usual special ids of small tokenizers
    return [[bos] + [rng.randrange(low, vocab) for _ in range(length - 1)] for _ in range(batch)]


def bench_engine(model: Any, prompts: list[list[int]], new: int) -> int:
    engine = TorchEngine(model, max_batch=len(prompts), max_len=len(prompts[0]) + new,
                         eos_token_ids=set(), seed=0)
    return generate_all(engine, prompts, new)


def generate_all(engine: TorchEngine, prompts: list[list[int]], new: int) -> int:
    """Every prompt in flight at once, ``new`` tokens each, stepped until done; tokens made."""
    for i, p in enumerate(prompts):
        engine.add(GenerateRequest(request_id=f"b{i}", trajectory_id="bench",
                                   prompt_token_ids=Int32Array(p), max_new_tokens=new,
                                   temperature=1.0, top_p=1.0))
    tokens = 0
    while engine.has_work():
        tokens += sum(len(r.token_ids) for r in engine.step())
    return tokens


@torch.inference_mode()
def bench_generate(model: Any, prompts: list[list[int]], new: int) -> int:
    ids = torch.tensor(prompts, dtype=torch.long)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                         pad_token_id=0)
    return (out.shape[1] - ids.shape[1]) * ids.shape[0]


def bench_generate_batch(model: Any, prompts: list[list[int]], new: int) -> int:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new, do_sample=True, temperature=1.0, top_p=1.0,
                              top_k=0, eos_token_id=-1, pad_token_id=0)
    results = model.generate_batch(prompts, generation_config=config, progress_bar=False)
    return sum(len(r.generated_tokens) for r in results.values())


_MANAGERS: dict[int, Any] = {}


def bench_cb_manager(model: Any, prompts: list[list[int]], new: int) -> int:
    """transformers' continuous batching in steady state: one started manager, reused
    (setup and warm-up happen in the untimed warm-up call)."""
    from transformers import GenerationConfig

    manager = _MANAGERS.get(id(model))
    if manager is None:
        config = GenerationConfig(max_new_tokens=new, do_sample=True, temperature=1.0, top_p=1.0,
                                  top_k=0, eos_token_id=-1, pad_token_id=0)
        manager = _MANAGERS[id(model)] = model.init_continuous_batching(generation_config=config)
        manager.start()
    ids = [manager.add_request(p, max_new_tokens=new, eos_token_id=-1) for p in prompts]
    tokens = 0
    for rid in ids:
        out = manager.get_result(request_id=rid, timeout=600)
        tokens += len(out.generated_tokens)
    return tokens


def stop_managers() -> None:
    for manager in _MANAGERS.values():
        manager.stop(block=True)
    _MANAGERS.clear()


def timed(fn: Callable[[Any, list[list[int]], int], int], model: Any, prompts: list[list[int]],
          new: int) -> tuple[int, float]:
    """(tokens, tokens/s) of one run; the untimed warm-up call builds what fn keeps (a manager)."""
    fn(model, prompts[:1], 2)
    t0 = time.perf_counter()
    tokens = fn(model, prompts, new)
    rate = tokens / (time.perf_counter() - t0)
    stop_managers()  # a started manager's thread would compete with the next contender
    return tokens, rate


CONTENDERS = {"engine": bench_engine, "generate": bench_generate,
              "generate_batch": bench_generate_batch, "cb_manager": bench_cb_manager}


def bench_fleet(model: Any, tokenizer: Any, rounds: int, batch: int, arrival_ms: float,
                group: int = 8, step_ms: float = 0.0, seed: int = 0,
                dump: str | None = None) -> dict[str, Any]:
    """CPU time of ``rounds`` rounds of ``batch`` staggered arithmetic requests (see module doc)."""
    import hashlib
    import resource

    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    engine = TorchEngine(model, max_batch=32, eos_token_ids={eos}, seed=seed)
    calls = [0]
    if not hasattr(engine, "forward"):  # an engine from before forward.py: count base calls
        base_forward = engine.base.forward

        def counting(*a: Any, **k: Any) -> Any:
            calls[0] += 1
            return base_forward(*a, **k)

        engine.base.forward = counting
    digest = hashlib.sha256()
    tokens = 0
    results: dict[str, Any] = {}

    def usage() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    # Prompts and arrival offsets drawn up front: the timed loop only drives the engine.
    plan = []
    for r in range(rounds):
        reqs = []
        for i in range(batch):
            if i % group == 0:  # GRPO: group_size requests share a prompt
                a, b = rng.randint(10, 99), rng.randint(10, 99)
                ids = tokenizer.backend_tokenizer.encode(f"{a}+{b}=").ids
            reqs.append((rng.uniform(0, arrival_ms / 1000),
                         GenerateRequest(request_id=f"r{r}-{i}", trajectory_id=f"t{r}-{i}",
                                         prompt_token_ids=Int32Array(ids), max_new_tokens=5,
                                         temperature=1.0, top_p=1.0, seed=r * batch + i)))
        reqs.sort(key=lambda x: x[0])
        plan.append(reqs)
    cpu0, wall0 = usage(), time.perf_counter()
    steps = 0
    for reqs in plan:
        start = time.perf_counter()
        pending = list(reqs)
        done = virtual = 0
        while done < len(reqs):
            now = virtual * step_ms / 1000 if step_ms else time.perf_counter() - start
            while pending and pending[0][0] <= now:
                engine.add(pending.pop(0)[1])
            if not engine.has_work():
                if step_ms:
                    virtual += 1
                else:
                    time.sleep(max(0.0, pending[0][0] - now))
                continue
            steps += 1
            virtual += 1
            for res in engine.step():
                done += 1
                tokens += len(res.token_ids)
                results[res.request_id] = res
    cpu, wall = usage() - cpu0, time.perf_counter() - wall0
    for rid in sorted(results):
        digest.update(rid.encode() + results[rid].token_ids.numpy().tobytes())
    if dump:
        Path(dump).write_text(json.dumps({rid: [r.token_ids.tolist(), r.logprobs.tolist()]
                                          for rid, r in sorted(results.items())}))
    forward_calls = engine.forward.calls if hasattr(engine, "forward") else calls[0]
    return {"rounds": rounds, "batch": batch, "group": group, "arrival_ms": arrival_ms,
            "step_ms": step_ms, "tokens": tokens,
            "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
            "cpu_s_per_1000_rounds": round(cpu * 1000 / rounds, 2),
            "cpu_us_per_token": round(cpu * 1e6 / tokens, 1),
            "steps_per_round": round(steps / rounds, 2),
            "forwards_per_round": round(forward_calls / rounds, 2),
            "forward": type(getattr(engine, "forward", None)).__name__,
            "tokens_digest": digest.hexdigest()[:16]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/tiny-qwen2")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=20)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", default=",".join(CONTENDERS), help="comma-separated contenders")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results here")
    p.add_argument("--fleet", type=int, default=0, metavar="ROUNDS",
                   help="measure the fleet's arrival pattern instead (see module doc)")
    p.add_argument("--fleet-batch", type=int, default=32)
    p.add_argument("--group", type=int, default=8, help="--fleet: requests per distinct prompt")
    p.add_argument("--arrival-ms", type=float, default=5.0)
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="--fleet: a virtual clock advancing this much per step (repeatable "
                        "batching whatever the machine's load); 0 = the real clock")
    p.add_argument("--dump", default=None, help="--fleet: write tokens and log-probs here")
    args = p.parse_args(argv)
    unknown = set(args.only.split(",")) - set(CONTENDERS)
    if unknown:
        p.error(f"unknown contender(s) {sorted(unknown)}; known: {', '.join(CONTENDERS)}")
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    if args.fleet:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        bench_fleet(model, tokenizer, min(args.fleet, 20), args.fleet_batch, args.arrival_ms,
                    args.group, args.step_ms)  # warm-up
        report = bench_fleet(model, tokenizer, args.fleet, args.fleet_batch, args.arrival_ms,
                             args.group, args.step_ms, dump=args.dump)
        report.update(threads=args.threads, torch=torch.__version__)
        print(json.dumps(report), flush=True)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(report, indent=2))
        return 0
    bos = model.config.bos_token_id if model.config.bos_token_id is not None else 1
    names = args.only.split(",")
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = _prompts(batch, args.prompt_len, model.config.vocab_size, bos, seed=batch)
        best = dict.fromkeys(names, 0.0)
        tokens = dict.fromkeys(names, 0)
        # Contenders take turns within each round, so load from other processes on a shared
        # machine hits them alike; the best round of each is reported.
        for _ in range(args.repeats):
            for name in names:
                tokens[name], rate = timed(CONTENDERS[name], model, prompts, args.new_tokens)
                best[name] = max(best[name], rate)
        for name in names:
            rows.append({"contender": name, "batch": batch, "tokens": tokens[name],
                         "tokens_per_s": round(best[name], 1)})
            print(f"batch {batch:3d}  {name:15s} {best[name]:10.1f} tok/s", flush=True)
    report = {"model": str(Path(args.model).resolve()), "threads": args.threads,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "repeats": args.repeats, "torch": torch.__version__, "results": rows}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
