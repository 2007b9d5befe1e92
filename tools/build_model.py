"""Build the tiny warm-started Qwen2 model the examples and tests train with RL.

    python -m rlfleet.tools.build_model --out models/tiny-qwen2
    python -m rlfleet.tools.build_model --out models/tiny-qwen2-tools --tasks arithmetic,frozenlake,tool_use

Two shipped models of the same architecture: `tiny-qwen2` (arithmetic, FrozenLake), which
the examples and tests train, and `tiny-qwen2-tools`, warm-started on the tool-use task too
(examples/tool_use.toml). The three-task model is not the default because, with the
tool-use skill sharing its 0.42M parameters, FrozenLake's recipe collapsed on one seed
(docs/guide/models.md, "Shipped models"); the two-task build follows the code path from before tool use.

1. A character-level tokenizer (one token per character, <pad> and <eos>, no <bos>),
   saved as tokenizer.json + tokenizer_config.json; AutoTokenizer loads it.
2. A Qwen2-architecture decoder (hidden 96, 3 layers, tied embeddings, ~0.42M
   parameters, float32: 1.7 MB) initialised from a fixed seed.
3. A short supervised warm start on generated data from the tasks, so the model
   knows the formats but leaves headroom for RL: greedy and sampled success of roughly
   0.2-0.4 on each task. Each task imitates a partly competent demonstrator with one habit, so
   the model plateaus inside the band while the right behaviour is already in its
   sampling distribution, which is what RL can sharpen: the arithmetic demonstrator
   usually adds column by column and forgets to carry (`no_carry_sum`), the FrozenLake
   one usually walks blindly down then right (`blind_action`), the tool-use one
   guesses a rough product instead of calling the calculator on most problems
   (`tool_use_examples`). A dev set is evaluated
   every `--eval-every` steps and the latest checkpoint inside the band is kept (see
   `closeness`): the longest-trained imitation of the demonstrators.
4. A final evaluation of the saved files on the held-out eval sets (n=256, seed 0: the
   numbers `python -m rlfleet.tools.evaluate` prints), recorded in warmstart.json.

Deterministic: one thread, seeded torch and Python RNGs, no data-loader workers; the
same seed gives the same weights and numbers. About 3 minutes of CPU on one core.

Random models of real architectures (qwen2-100m, qwen2-0.5b), for memory and step-time
costs rather than learning: tools/model_shapes.py (`python -m rlfleet.tools.model_shapes --list`).
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from rlfleet.common.sandbox.parent import SandboxResult
from rlfleet.daemons.tasks import Prompt, Task, get_task
from rlfleet.daemons.tasks.episodes import evaluate_model
from rlfleet.daemons.tasks.frozenlake import ACTIONS, optimal_actions, parse_observation
from rlfleet.daemons.tasks.tool_use import ToolUseTask, observation_after
from rlfleet.tools.evaluate import WARMSTART_FILE, load
from rlfleet.tools.options import add_options

SPECIAL_TOKENS = ["<pad>", "<eos>"]  # ids 0, 1
# Digits and operators, a few spare punctuation marks for later tasks, blank and newline,
# the FrozenLake map (S F H G, P = agent) and its actions (L D R U).
CHARS = list("0123456789+-*/=()<>:,.? \n") + list("SFHGP") + list(ACTIONS)

# The difficulty the shipped model is calibrated for (recorded in warmstart.json).
TASKS: dict[str, dict[str, Any]] = {
    # Two-digit addition: a model this size learns it fully from right answers (0.98
    # greedy in ~2000 steps); carries are frequent (only ~1 in 4 problems has none), so
    # the no-carry habit fails often.
    "arithmetic": {"digits": 2, "min_digits": 2, "ops": "+"},
    # p=0.75 (more holes than gymnasium's default 0.8) so that walking down-then-right
    # blindly, the demonstrator's habit (see frozenlake_examples), fails often.
    "frozenlake": {"size": 4, "p": 0.75, "max_turns": 12},
    # Two-digit products, which the model cannot compute but the calculator tool can.
    "tool_use": {"digits": 2, "min_digits": 2, "max_turns": 2, "tool_timeout_s": 5.0},
}


class TrustedToolUse(ToolUseTask):
    """tool_use whose calls of the form "a*b" (digits only: nothing else can run) are
    computed here rather than in a sandboxed child: the warm start evaluates thousands
    of episodes. Any other call still goes to the sandbox."""

    def run_tool(self, expression: str) -> SandboxResult:
        a, star, b = expression.partition("*")
        if star and a.isdigit() and b.isdigit() and len(a) + len(b) <= 12:
            return SandboxResult("", "", 0, f"{int(a) * int(b)}\n", "", 0.0, 0.0, 0, 0, 0)
        return super().run_tool(expression)


def estimate(a: int, b: int) -> str:
    """The guessing habit: the product of the operands rounded to tens (37*48 -> "2000")."""
    return str(round(a, -1) * round(b, -1))


def tool_use_examples(task: Task, n: int, seed: int, tool_low: float,
                      tool_high: float) -> list[tuple[str, str]]:
    """(turn prompt, completion) pairs from a demonstrator that often guesses.

    On the first turn it calls the tool with probability `tool_high` when the first
    factor ends in 0, 1 or 2 (about 30% of problems), else `tool_low`, and otherwise
    answers with `estimate` (almost always wrong); after a call it copies the output.
    Imitating it gives a greedy policy that calls the tool on those problems only, and
    samples calls on the others: RL can spread the calls to every problem.
    """
    rng = random.Random(seed)
    out = []
    for p in task.make_prompts("train", n, seed=seed):
        a, _, b = p.question.partition("*")
        p_tool = tool_high if int(a) % 10 < 3 else tool_low
        call = f"<{p.question}>"
        first = call if rng.random() < p_tool else estimate(int(a), int(b))
        out.append((task.format_turn(p.question), first))
        out.append((task.format_turn(observation_after(p.question, call, p.answer)), p.answer))
    return out


def byte_level(ch: str) -> str:
    """GPT-2's byte-to-unicode mapping of one ASCII character (' ' -> 'Ġ', '\\n' -> 'Ċ')."""
    b = ord(ch)
    if 33 <= b <= 126:
        return ch
    # The bytes GPT-2 remaps are numbered 256, 257, ... in byte order; all 33 below '!'
    # come first, so for them the offset is the byte itself.
    if b < 33:
        return chr(256 + b)
    raise ValueError(f"no byte-level token for {ch!r} in this character vocabulary")


def build_tokenizer(out: Path) -> Any:
    """A character tokenizer: byte-level BPE whose vocabulary is single characters, no merges.

    It is built as a Qwen2Tokenizer on purpose: transformers 5 forces that class on any
    checkpoint whose config says model_type "qwen2" (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS)
    and rebuilds the pipeline from the vocabulary, so any other tokenizer would load
    differently from how it was saved (newlines silently dropped). No <bos>: a sequence
    starts with the prompt's first character. Characters outside CHARS are dropped.
    """
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({byte_level(ch): len(SPECIAL_TOKENS) + i for i, ch in enumerate(CHARS)})
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, bos_token=None,
                               eos_token="<eos>", pad_token="<pad>",
                               clean_up_tokenization_spaces=False, model_max_length=256)
    tokenizer.save_pretrained(str(out))
    return tokenizer


def build_model(tokenizer: Any, hidden: int, layers: int, seed: int) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, use_cache=True)
    return Qwen2ForCausalLM(config)


def no_carry_sum(a: int, b: int) -> str:
    """The no-carry habit: each column's digit sum mod 10, carries dropped (57+68 -> "15")."""
    width = max(len(str(a)), len(str(b)))
    xs, ys = str(a).zfill(width), str(b).zfill(width)
    return str(int("".join(str((int(x) + int(y)) % 10) for x, y in zip(xs, ys))))


def arithmetic_examples(task: Task, n: int, seed: int, slip: float) -> list[tuple[str, str]]:
    """(turn prompt, answer) pairs from a demonstrator that forgets to carry.

    With probability `slip` the label of an addition is `no_carry_sum` (the same as the
    right answer when no column carries), else the right answer. Imitating it gives a
    model whose greedy answer drops carries while sampling sometimes carries right.
    """
    rng = random.Random(seed)
    out = []
    for p in task.make_prompts("train", n, seed=seed):
        answer = p.answer
        a, plus, b = p.question.partition("+")
        if plus and rng.random() < slip:
            answer = no_carry_sum(int(a), int(b))
        out.append((task.format_turn(p.question), answer))
    return out


def blind_action(desc: list[str], row: int, col: int) -> str:
    """The hole-blind habit: straight down to the bottom row, then right to G."""
    return "D" if row < len(desc) - 1 else "R"


def frozenlake_examples(task: Task, n_maps: int, seed: int, explore: float,
                        habit: float, label_noise: float) -> list[tuple[str, str]]:
    """(turn prompt, action) pairs labelled by a partly competent demonstrator.

    Each label is a uniformly random action with probability `label_noise`, else the
    hole-blind habit with probability `habit`, else a shortest-path action. Imitating
    it gives a policy whose greedy action follows the habit (so it walks into holes on
    many maps) while sampling sometimes finds the way round: success in the band, and
    an RL signal in exactly the states that matter. States come from episodes of a
    behaviour policy that acts randomly with probability `explore`, else optimally.
    """
    rng = random.Random(seed)
    out = []
    for prompt in task.make_prompts("train", n_maps, seed=seed):
        env = task.make_env()
        obs, done = env.reset(prompt), False
        while not done:
            desc, r, c = parse_observation(obs)
            best = optimal_actions(desc, r, c)
            if not best:  # cannot happen on a valid map off a hole; stop to be safe
                break
            if rng.random() < label_noise:
                label = rng.choice(ACTIONS)
            elif rng.random() < habit:
                label = blind_action(desc, r, c)
            else:
                label = rng.choice(best)
            out.append((task.format_turn(obs), label))
            action = rng.choice(ACTIONS) if rng.random() < explore else rng.choice(best)
            obs, _, done, _ = env.step(action)
    return out


def encode(tokenizer: Any, examples: list[tuple[str, str]]) -> list[tuple[list[int], int]]:
    """Token ids of prompt+target+<eos>, and the prompt length (loss starts after it)."""
    prompts = tokenizer([p for p, _ in examples])["input_ids"]
    targets = tokenizer([t for _, t in examples], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return [(p + t + [eos], len(p)) for p, t in zip(prompts, targets)]


def collate(batch: list[tuple[list[int], int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and labels (-100 on prompt and padding)."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for row, (seq, n_prompt) in enumerate(batch):
        ids[row, :len(seq)] = torch.tensor(seq)
        labels[row, n_prompt:len(seq)] = torch.tensor(seq[n_prompt:])
    return ids, labels


def closeness(scores: dict[str, float], low: float, high: float, step: int) -> tuple[float, int]:
    """Sort key for checkpoints, smaller is better: how far the worst score is outside
    [low, high], then later steps first (they imitate the demonstrators more closely,
    so the right behaviour they sometimes sample is better learned)."""
    outside = max(max(low - v, v - high, 0.0) for v in scores.values())
    return round(outside, 6), -step


def measure(model: Any, tokenizer: Any, tasks: dict[str, Task],
            prompts: dict[str, list[Prompt]], seed: int) -> dict[str, float]:
    """Success of each task, greedy and sampled, keyed "task/greedy" and "task/sample"."""
    was_training = model.training
    model.eval()
    scores = {}
    for name, task in tasks.items():
        for greedy in (True, False):
            key = f"{name}/{'greedy' if greedy else 'sample'}"
            scores[key] = evaluate_model(model, tokenizer, task, prompts[name], greedy, seed)
    model.train(was_training)
    return scores


def supervise(model: Any, tokenizer: Any, tasks: dict[str, Task],
              data: dict[str, list[tuple[list[int], int]]], dev: dict[str, list[Prompt]],
              args: argparse.Namespace, t_start: float) -> tuple[int, list[dict[str, Any]]]:
    """Train on all tasks at once; load the checkpoint closest to the band into `model`.

    Every task is in every batch (training one alone makes the model forget the others
    within a few hundred steps). Every imitation target is only partly competent, so
    every task plateaus inside the band; training runs `max_steps` and the kept
    checkpoint is the best by `closeness`.
    Returns (kept step, history of dev scores).
    """
    rng = random.Random(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    n_arith = round(args.batch_size * args.arith_share)
    n_tool = round(args.batch_size * args.tool_share) if "tool_use" in tasks else 0
    counts = {"arithmetic": n_arith, "tool_use": n_tool,
              "frozenlake": args.batch_size - n_arith - n_tool}
    if "tool_use" not in tasks:  # the two-task build draws exactly as it did before tool use
        del counts["tool_use"]
    history: list[dict[str, Any]] = []
    best: tuple[tuple[float, int], int, dict[str, torch.Tensor]] | None = None
    model.train()
    for step in range(1, args.max_steps + 1):
        batch = [ex for name, k in counts.items() for ex in rng.sample(data[name], k)]
        ids, labels = collate(batch, tokenizer.pad_token_id)
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % args.eval_every:
            continue
        scores = measure(model, tokenizer, tasks, dev, args.seed)
        history.append({"step": step, "loss": round(loss.item(), 4), **scores})
        print(f"step {step:5d} loss {loss.item():.3f} "
              + " ".join(f"{k} {v:.2f}" for k, v in scores.items())
              + f" ({time.perf_counter() - t_start:.0f} s)", flush=True)
        key = closeness(scores, args.band_low, args.band_high, step)
        if best is None or key < best[0]:
            best = (key, step, copy.deepcopy(model.state_dict()))
    if best is None:
        raise ValueError(f"max_steps ({args.max_steps}) must be >= eval_every ({args.eval_every})")
    model.load_state_dict(best[2])
    return best[1], history


def warm_start(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    random.seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    model = build_model(tokenizer, args.hidden, args.layers, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    names = [t.strip() for t in args.tasks.split(",")]
    if sorted(names) not in (["arithmetic", "frozenlake"], ["arithmetic", "frozenlake", "tool_use"]):
        raise SystemExit(f"--tasks: arithmetic,frozenlake or arithmetic,frozenlake,tool_use, got {args.tasks!r}")
    tasks = {name: get_task(name, **d) for name, d in TASKS.items() if name in names}
    data = {
        "arithmetic": encode(tokenizer, arithmetic_examples(
            tasks["arithmetic"], args.arith_examples, args.seed, args.carry_slip)),
        "frozenlake": encode(tokenizer, frozenlake_examples(
            tasks["frozenlake"], args.lake_maps, args.seed, args.explore, args.habit,
            args.label_noise)),
    }
    if "tool_use" in names:
        tasks["tool_use"] = TrustedToolUse(**TASKS["tool_use"])
        data["tool_use"] = encode(tokenizer, tool_use_examples(
            tasks["tool_use"], args.tool_examples, args.seed, args.tool_low, args.tool_high))
    # Checkpoints are chosen on another sample of the eval distribution (seed 1) than
    # the one the recorded final numbers come from (seed 0).
    dev = {name: t.make_prompts("eval", args.dev_n, seed=1) for name, t in tasks.items()}
    print(f"data: {', '.join(f'{k} {len(v)} examples' for k, v in data.items())}; "
          f"params {n_params:,}", flush=True)

    kept_step, history = supervise(model, tokenizer, tasks, data, dev, args, t_start)
    model.generation_config.do_sample = False
    model.generation_config.max_new_tokens = 8
    model.save_pretrained(str(out), safe_serialization=True)
    # Final numbers from the files as saved, loaded the way every consumer loads them.
    model, tokenizer = load(out)
    final = measure(model, tokenizer, tasks,
                    {n: t.make_prompts("eval", args.final_n, seed=0) for n, t in tasks.items()},
                    seed=0)
    wall = time.perf_counter() - t_start
    record = {
        "seed": args.seed, "steps": kept_step, "steps_trained": history[-1]["step"],
        "wall_time_s": round(wall, 1), "cpu_time_s": round(time.process_time(), 1),
        "threads": args.threads, "params": n_params,
        "hyperparameters": {k: getattr(args, k) for k in (
            "hidden", "layers", "lr", "batch_size", "arith_share", "arith_examples", "carry_slip",
            *(("tool_share", "tool_examples", "tool_low", "tool_high") if "tool_use" in names else ()),
            "lake_maps", "explore", "habit", "label_noise", "eval_every", "dev_n",
            "max_steps", "band_low", "band_high")},
        "tasks": {name: TASKS[name] for name in tasks},
        "eval": {"split": "eval", "n": args.final_n, "seed": 0, "temperature": 1.0,
                 "success": final},
        "history": history,
    }
    (out / WARMSTART_FILE).write_text(json.dumps(record, indent=2) + "\n")
    for key, v in final.items():
        print(f"eval {key}: {v:.3f} (n={args.final_n})")
    print(f"kept step {kept_step}; wrote {out} in {wall:.0f} s "
          f"({time.process_time():.0f} s CPU)")
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="models/tiny-qwen2")
    p.add_argument("--tasks", default="arithmetic,frozenlake",
                   help="arithmetic,frozenlake (models/tiny-qwen2) or arithmetic,frozenlake,tool_use "
                        "(models/tiny-qwen2-tools)")
    add_options(p, seed=0, threads=1, hidden=96, layers=3, lr=1e-3, batch_size=64, max_steps=3000,
                arith_share=(0.5, "arithmetic batch share"), arith_examples=20000,
                carry_slip=(0.8, "no-carry label rate"), tool_share=(0.25, "tool_use batch share"),
                tool_examples=10000, tool_low=(0.25, "tool-call rate, most problems"),
                tool_high=(0.9, "tool-call rate, a*b with a%%10<3"), lake_maps=2000,
                explore=(0.3, "behaviour random-action rate"), habit=(0.75, "hole-blind label rate"),
                label_noise=(0.3, "random-label rate"), eval_every=100, dev_n=256, final_n=256, band_low=0.2,
                band_high=0.4)
    warm_start(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
