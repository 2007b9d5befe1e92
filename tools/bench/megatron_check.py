"""The megatron trainer backend against the torch one: per-token log-probs before and after
one identical step, and step times (python -m rlfleet.tools.bench.megatron_check).

Both learners start from the same HF folder (default models/tiny-qwen2) and take the same
GRPO batch with the same loss ([trainer.loss] default, PPO-clip 0.2), lr and clipping:

- the megatron backend (daemons/trainer/megatron/learner.py) on the GPU (--device cuda),
  float32 parameters, TF32 off (the figures compare arithmetic, not precision modes);
- the torch backend (daemons/trainer/learner.py) where it runs in the fleet: on the CPU.

Recorded: max and mean |logp_megatron - logp_torch| over every real token of the batch
(the log-prob of each next token, as the loss sees them) at version 0 and after step 1,
the same for the published HF-named tensors after step 1, both learners' step-1 stats
(loss, grad_norm, ...), step times (step 1, then the median of --timed_steps more steps on
the same batch), the machine, torch and megatron-core versions. Writes --out as JSON.
Also step 1's gradients under HF names (max |difference| / max |gradient|), and a control:
the HF model itself on the megatron learner's device, against the megatron model (same
device: the mapping's own error) and against the CPU (the devices' float32 arithmetic).
Exits 1 when the version-0 log-probs differ from the same-device HF model's by more than
--tolerance (1e-3) or the gradients by more than --grad-tolerance (1e-3, relative: they
come from two devices), so a wrong mapping fails loudly instead of publishing a figure. After the step the weights
differ by up to about 2 x lr wherever a gradient is near zero (Adam's first update is
about lr x sign(gradient)), so the after-step figures are recorded, not judged.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def make_batch(vocab: int, groups: int, group_size: int, seed: int):
    """GRPO groups of one-turn trajectories: a random prompt per group, completions of
    random lengths, rewards 0/1 (every group carries signal); behaviour log-probs are
    filled in by the caller (the policy's own, so step 1 is on-policy)."""
    import random

    from rlfleet.common.wire.arrays import Float32Array, Int32Array
    from rlfleet.common.wire.messages import ScoredTrajectory, Trajectory, Turn

    rng = random.Random(seed)
    out = []
    for p in range(groups):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(12, 28))]
        group = []
        for k in range(group_size):
            tokens = [rng.randrange(4, vocab) for _ in range(rng.randint(8, 64))]
            turn = Turn(prompt_token_ids=Int32Array(prompt), token_ids=Int32Array(tokens),
                        logprobs=Float32Array([0.0] * len(tokens)), weight_version=0,
                        observation="", action="")
            traj = Trajectory(trajectory_id=f"p{p}-g{k}", prompt_id=p, group_id=f"p{p}", task="bench",
                              turns=[turn], env_reward=float(k % 2))
            group.append(ScoredTrajectory(trajectory=traj, reward=float(k % 2)))
        out.append(group)
    return out


def with_behaviour(groups, logp):
    """The groups with each turn's behaviour log-probs taken from ``logp`` [N, T-1] (row n:
    the n-th trajectory, target column j: token j+1)."""
    from msgspec.structs import replace

    from rlfleet.common.wire.arrays import Float32Array

    out, n = [], 0
    for group in groups:
        out.append([])
        for st in group:
            turn = st.trajectory.turns[0]
            p, g = len(turn.prompt_token_ids), len(turn.token_ids)
            turn = replace(turn, logprobs=Float32Array(logp[n, p - 1:p - 1 + g].tolist()))
            out[-1].append(replace(st, trajectory=replace(st.trajectory, turns=[turn])))
            n += 1
    return out


def rows(groups):
    """The batch's rows: right-padded ids [N, T], the mask of generated targets [N, T-1],
    the row lengths [N] (the learners build the same rows: grpo.build_batch)."""
    from rlfleet.daemons.trainer import grpo

    flat = [st for g in groups for st in g]
    batch = grpo.build_batch(flat, [0.0] * len(flat), pad_id=0)
    return batch.input_ids, batch.loss_mask, batch.attention_mask.sum(dim=1)


def torch_logprobs(model, ids, lengths, device="cpu"):
    """An HF model's log-probs [N, T-1] (the torch learner's ``model``, or a copy on the GPU)."""
    import torch

    from rlfleet.daemons.trainer import grpo

    out = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    with torch.no_grad():
        for n in range(ids.shape[0]):  # one row at a time: no padding in the reference
            ln = int(lengths[n])
            row = ids[n:n + 1, :ln].to(device)
            out[n, :ln - 1] = grpo.token_logprobs(model(input_ids=row).logits, row)[0][0].cpu()
    return out


def megatron_logprobs(learner, ids):
    import torch

    with torch.no_grad():
        return learner.forward_logprobs(ids)[0].float().cpu()


def grad_diff(ref, mega) -> dict[str, float]:
    """Step 1's gradients (still on the parameters after the step) under HF names: the
    mapping's check before Adam, whose first update is about lr x sign(gradient) and so
    turns float noise in near-zero gradients into differences of up to 2 x lr."""
    from rlfleet.daemons.trainer.megatron import weights as mw

    theirs = {n: p.grad for n, p in ref.model.named_parameters()}
    named = {n: p.grad for n, p in mega.gpt.named_parameters()}
    ours = mw.mcore_to_hf(named, mega.shape)
    worst = scale = 0.0
    for n, g in theirs.items():
        worst = max(worst, float((ours[n].float().cpu() - g).abs().max()))
        scale = max(scale, float(g.abs().max()))
    return {"max_abs": worst, "max_abs_grad": scale, "relative": worst / scale}


def diff(a, b, mask) -> dict[str, float]:
    d = (a - b).abs()[mask > 0]
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean()), "tokens": int(mask.sum())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "models" / "tiny-qwen2"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)  # the spec's default learning_rate
    ap.add_argument("--timed-steps", type=int, default=5)
    ap.add_argument("--torch-threads", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    # 1e-3: on the H100 the HF model itself differs from its CPU run by up to 2e-4 on the
    # least likely tokens (float32 summed in another order); a wrong mapping differs by ~1.
    ap.add_argument("--tolerance", type=float, default=1e-3)
    ap.add_argument("--grad-tolerance", type=float, default=1e-3)
    ap.add_argument("--out", default=str(REPO / "tools" / "bench" / "results" / "megatron_h100.json"))
    args = ap.parse_args(argv)

    import torch

    from rlfleet.daemons.trainer.learner import Learner
    from rlfleet.daemons.trainer.losses import PPOClipLoss
    from rlfleet.daemons.trainer.megatron.learner import MegatronLearner

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref = Learner(args.model, lr=args.lr, loss=PPOClipLoss(), seed=args.seed, threads=args.torch_threads)
    mega = MegatronLearner(args.model, lr=args.lr, loss=PPOClipLoss(), seed=args.seed, device=args.device)
    groups = make_batch(ref.vocab_size, args.groups, args.group_size, args.seed)
    ids, mask, lengths = rows(groups)
    # Behaviour log-probs: the policy's own at version 0 (an on-policy first step).
    before_ref = torch_logprobs(ref.model, ids, lengths)
    groups = with_behaviour(groups, before_ref)
    before_mega = megatron_logprobs(mega, ids)
    # The control: the same HF model on the megatron learner's device. Float32 on a GPU
    # sums in another order than on the CPU; this separates that from megatron's part.
    from transformers import AutoModelForCausalLM

    hf_dev = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device).eval()
    before_hf_dev = torch_logprobs(hf_dev, ids, lengths, args.device)
    del hf_dev

    stats_ref, stats_mega = ref.train_step(groups), mega.train_step(groups)
    grads = grad_diff(ref, mega)
    after_ref, after_mega = torch_logprobs(ref.model, ids, lengths), megatron_logprobs(mega, ids)
    t_ref, t_mega = ref.state_tensors(), mega.state_tensors()
    weights = max(float(abs(t_ref[n] - t_mega[n]).max()) for n in t_ref)
    times_ref = [ref.train_step(groups)["step_s"] for _ in range(args.timed_steps)]
    times_mega = [mega.train_step(groups)["step_s"] for _ in range(args.timed_steps)]
    later = diff(megatron_logprobs(mega, ids), torch_logprobs(ref.model, ids, lengths), mask)

    keys = ("loss", "grad_norm", "ratio_mean", "clip_frac", "approx_kl", "entropy", "tokens")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    import megatron.core

    result = {
        "what": "megatron backend (GPU) vs torch backend (CPU): same HF weights, same batch, "
                "same PPO-clip loss and lr; per-token log-prob differences over generated tokens",
        "command": "python -m rlfleet.tools.bench.megatron_check " + " ".join(argv or sys.argv[1:]),
        "machine": {"gpu": gpu, "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "megatron_core": megatron.core.__version__,
                    "tf32": False, "megatron_device": args.device, "torch_backend_device": "cpu",
                    "torch_threads": args.torch_threads},
        "model": str(Path(args.model).name), "params": sum(a.size for n, a in t_ref.items()
                                                            if n != "lm_head.weight"),
        "batch": {"groups": args.groups, "group_size": args.group_size, "rows": int(ids.shape[0]),
                  "width": int(ids.shape[1]), "generated_tokens": int(mask.sum()), "lr": args.lr},
        "logprob_diff_before": diff(before_mega, before_ref, mask),
        "logprob_diff_before_megatron_vs_hf_same_device": diff(before_mega, before_hf_dev, mask),
        "logprob_diff_before_hf_device_vs_hf_cpu": diff(before_hf_dev, before_ref, mask),
        "logprob_diff_after_step_1": diff(after_mega, after_ref, mask),
        f"logprob_diff_after_step_{1 + args.timed_steps}": later,
        "grad_diff_step_1": grads,
        "weights_max_abs_diff_after_step_1": weights,
        "logprob_change_by_step_1": diff(after_ref, before_ref, mask),
        "step_1": {"torch": {k: stats_ref[k] for k in keys}, "megatron": {k: stats_mega[k] for k in keys}},
        "step_s": {"torch_cpu_first": stats_ref["step_s"], "megatron_gpu_first": stats_mega["step_s"],
                   "torch_cpu_median": statistics.median(times_ref),
                   "megatron_gpu_median": statistics.median(times_mega),
                   "timed_steps": args.timed_steps},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    # Pass: the same function as the HF model on the same device (version 0) and the same
    # gradient as the torch learner's; the after-step figures are recorded, not judged
    # (Adam's first step, see grad_diff).
    same = result["logprob_diff_before_megatron_vs_hf_same_device"]["max_abs"]
    result["tolerance"] = {"logprob_same_device": args.tolerance, "grad_relative": args.grad_tolerance}
    result["ok"] = same <= args.tolerance and grads["relative"] <= args.grad_tolerance
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
