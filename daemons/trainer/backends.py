"""The trainer-backend seam: ``[trainer.backend]``, one kind per way of making versions.

    [trainer.backend]
    kind = "torch"       # default: the policy itself, trained by learner.Learner

    [trainer.backend]
    kind = "sim"         # a timing model: sim_learner.SimLearner
    time_scale = 0.02
    weight_mib = 64

    [trainer.backend]
    kind = "megatron"    # the policy as a megatron-core GPTModel:
    tensor_parallel = 1  # megatron.learner.MegatronLearner (HF weights in and out); the
    pipeline_parallel = 1  # learner takes tensor x data parallel ranks (one process each),
    data_parallel = 1    # the daemon runs one rank until its trainer group is built
    precision = "float32"  # or "bfloat16" (float32 master weights and Adam state)

Each builds an object with the learner interface the rest of the trainer uses
(worker.py, training.py, checkpointing.py): ``version``, ``vocab_size``,
``model`` (None: nothing to evaluate), ``train_step(groups) -> stats``,
``state_tensors()``, ``save_checkpoint`` and ``load_checkpoint``.

Registered in pyproject.toml (``rlfleet.trainer_backends``). This module is imported
whenever a spec is validated, so it holds configs and constants only; ``build``
imports torch (torch kind), numpy (sim kind) or megatron-core (megatron kind, the
optional extra ``rlfleet[megatron]``).

The sim kind's defaults model Laminar's 7B setting (Laminar §8, "Testbed" and
"Models": Qwen2.5-7B trained on 64 H800 GPUs, 8 per machine, 8 x 400 Gbps between
machines). A step of T tokens (every prompt and completion token of the batch) takes

    fixed_s + T / tokens_per_s   model seconds, slept as  time_scale x that  wall seconds

- ``tokens_per_s`` = GPUS x PEAK_FLOPS x MFU / (6 x PARAMS): a dense transformer's
  forward and backward cost about 6 FLOPs per parameter per token (Kaplan et al. 2020,
  "Scaling Laws for Neural Language Models", §2.1); PARAMS = 7.62e9 (Qwen2.5-7B's model
  card); PEAK_FLOPS = 989e12, an H800 SXM's dense bf16 peak (the same die as the H100
  SXM; NVIDIA's datasheet); MFU = 0.40, *an assumption*: what Megatron-style training
  of 7B dense models typically reaches, and optimistic for RL batches of uneven lengths.
  That gives 64 x 989e12 x 0.40 / (6 x 7.62e9) = 553,771 tokens/s. (Laminar also
  recomputes old log-probs, a forward pass of 2 more FLOPs per parameter per token; set
  ``tokens_per_s`` 25% lower to model that.)
- ``fixed_s`` = 1.0, per step whatever its size: the gradient all-reduce of 7.62e9 bf16
  gradients across 8 machines (a ring moves about 2 x 15.2 GB per GPU, at 50 GB/s per
  GPU of inter-machine bandwidth ~0.6 s) plus the optimizer step and launch overheads,
  rounded up. Also an assumption, stated so it can be argued with.
- ``time_scale`` = 0.02 wall seconds per model second: the sim rollout engine's meaning,
  so one factor scales the whole simulated fleet.
- ``weight_mib`` = 64: bytes really published through the relay chain each step (the
  7B model's 15 GB would not fit this machine's memory several times over); the relay's
  cost per step is then real, its size scaled down.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictInt

from rlfleet.common.spec.fields import PosInt
from rlfleet.common.spec.registry import Kind, KindConfig, Problem, import_failure

# -- the sim backend's model (see the module docstring for the sources) ------------------
SIM_PARAMS = 7.62e9          # Qwen2.5-7B
SIM_GPUS = 64                # Laminar §8: 7B trained on 64 H800s
SIM_PEAK_FLOPS = 989e12      # H800 SXM dense bf16, per GPU
SIM_MFU = 0.40               # assumed model FLOPs utilisation
SIM_TOKENS_PER_S = SIM_GPUS * SIM_PEAK_FLOPS * SIM_MFU / (6 * SIM_PARAMS)  # ~553,771
SIM_FIXED_S = 1.0            # all-reduce + optimizer + overheads per step (assumed)
SIM_TIME_SCALE = 0.02        # wall s per model s, as the sim rollout engine
SIM_WEIGHT_MIB = 64
# Above this a weight_mib is a typo (16 GiB is a 7B model's bf16 weights with room to
# spare); check() below then holds it against this machine's memory.
MAX_WEIGHT_MIB = 16384
# Snapshots of the weights alive at once on the trainer's host: the one being made, the
# one waiting in the publisher's slot and the one being pushed (publishing.py).
TRAINER_SNAPSHOTS = 3


class TrainerBackend(Kind):
    """A trainer backend kind: ``build(config, spec=JobSpec)`` returns the learner."""

    @classmethod
    def prewarm(cls, config: Any, /, *, model_path: str) -> None:
        """Import what ``build`` will need, ahead of leadership (a standby that takes over
        then starts training sooner). Best effort: the build reports errors."""


class TorchBackendConfig(KindConfig):
    kind: Literal["torch"] = "torch"


class TorchBackend(TrainerBackend):
    """``learner.Learner``: the HF policy on CPU or one GPU, trained with [trainer.loss]."""

    Config = TorchBackendConfig

    @classmethod
    def build(cls, config: TorchBackendConfig, /, *, spec: Any, **_: Any) -> Any:
        from rlfleet.common.devices import torch_device
        from rlfleet.common.spec.seams import POLICY_LOSSES

        from .learner import Learner  # torch: imported only by a leader

        t = spec.trainer
        raw = os.environ.get("RLFLEET_TORCH_THREADS", "1")
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"RLFLEET_TORCH_THREADS must be an integer >= 1, got {raw!r}")
        return Learner(spec.model.path, lr=t.learning_rate, loss=POLICY_LOSSES.build(t.loss),
                       seed=spec.job.seed, threads=int(raw), device=torch_device(),  # its GPU, if given
                       lr_schedule=t.lr_schedule, warmup_steps=t.warmup_steps,
                       total_steps=t.max_steps,
                       # The rollout reports behaviour log-probs at temperature 1 (the
                       # policy itself, see daemons/rollout/engines/torch_engine.py); the ratio must
                       # compare like with like, whatever temperature sampling used.
                       temperature=1.0)

    @classmethod
    def prewarm(cls, config: TorchBackendConfig, /, *, model_path: str) -> None:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        from . import learner  # noqa: F401 — torch

        MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(model_path))]  # imports it


Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class SimBackendConfig(KindConfig):
    kind: Literal["sim"] = "sim"
    # Wall seconds per model second (0.02: a 60 s model step sleeps 1.2 s).
    time_scale: Annotated[Finite, Field(gt=0, le=10)] = SIM_TIME_SCALE
    # Model tokens trained per model second (prompt + completion tokens of the batch).
    tokens_per_s: Annotated[Finite, Field(gt=0, le=1e12)] = SIM_TOKENS_PER_S
    fixed_s: Annotated[Finite, Field(ge=0, le=3600)] = SIM_FIXED_S  # model seconds per step
    # MiB of weights published through the relay chain per version.
    weight_mib: Annotated[StrictInt, Field(gt=0, le=MAX_WEIGHT_MIB)] = SIM_WEIGHT_MIB


class SimBackend(TrainerBackend):
    """``sim_learner.SimLearner``: sleeps the modeled step time, publishes stamped bytes."""

    Config = SimBackendConfig

    @classmethod
    def build(cls, config: SimBackendConfig, /, *, spec: Any, **_: Any) -> Any:
        from .sim_learner import SimLearner

        return SimLearner(spec.model.path, time_scale=config.time_scale,
                          tokens_per_s=config.tokens_per_s, fixed_s=config.fixed_s,
                          weight_mib=config.weight_mib)

    @classmethod
    def check(cls, config: SimBackendConfig, sections: Mapping[str, BaseModel]) -> list[Problem]:
        relay = sections.get("relay")
        keep = int(getattr(relay, "keep_versions", 2))
        need = (config.weight_mib << 20) * (TRAINER_SNAPSHOTS + keep)
        have = _machine_memory_bytes()
        if have is None or need <= have:
            return []
        return [(("weight_mib",),
                 f"{config.weight_mib} MiB of weights: up to {TRAINER_SNAPSHOTS} snapshots in the "
                 f"trainer plus relay.keep_versions ({keep}) in the relay's shared memory take "
                 f"{need / 2**30:.1f} GiB, more than this machine's memory "
                 f"({have / 2**30:.1f} GiB)")]


class MegatronBackendConfig(KindConfig):
    kind: Literal["megatron"] = "megatron"
    # The trainer's parallel layout (megatron/layout.py): one process per rank. check()
    # says what the model cannot take, and refuses more than one rank until the daemon
    # forms a trainer group (the learner itself runs TP x DP; tests/daemons/trainer/
    # test_megatron_parallel.py).
    tensor_parallel: PosInt = 1
    pipeline_parallel: PosInt = 1
    data_parallel: PosInt = 1
    # bfloat16: bf16 parameters and compute, float32 master weights and Adam state.
    precision: Literal["float32", "bfloat16"] = "float32"


class MegatronBackend(TrainerBackend):
    """``megatron.learner.MegatronLearner``: a megatron-core GPTModel on one CUDA GPU,
    built from the HF model and publishing HF-named tensors, trained with [trainer.loss]."""

    Config = MegatronBackendConfig

    @classmethod
    def build(cls, config: MegatronBackendConfig, /, *, spec: Any, **_: Any) -> Any:
        from rlfleet.common.spec.seams import POLICY_LOSSES

        from .megatron.learner import MegatronLearner  # torch, megatron-core

        t = spec.trainer
        return MegatronLearner(spec.model.path, device=megatron_device(), lr=t.learning_rate,
                               loss=POLICY_LOSSES.build(t.loss), seed=spec.job.seed,
                               lr_schedule=t.lr_schedule, warmup_steps=t.warmup_steps,
                               total_steps=t.max_steps, temperature=1.0,  # as TorchBackend
                               tensor_parallel=config.tensor_parallel,
                               pipeline_parallel=config.pipeline_parallel,
                               data_parallel=config.data_parallel, precision=config.precision)

    @classmethod
    def unavailable(cls, config: MegatronBackendConfig, /) -> str:
        # `rlfleet job validate` asks: the optional extra rlfleet[megatron] may be missing
        # where the trainer will run (found at validation, not by a trainer that crash-loops).
        return import_failure("megatron.core")

    @classmethod
    def prewarm(cls, config: MegatronBackendConfig, /, *, model_path: str) -> None:
        from .megatron import learner as megatron_learner

        megatron_learner.megatron_version()

    @classmethod
    def check(cls, config: MegatronBackendConfig, sections: Mapping[str, BaseModel]) -> list[Problem]:
        from .megatron.layout import Layout  # torch-free
        from .megatron.weights import UnsupportedModel, shape_from_hf  # torch-free

        problems: list[Problem] = []
        layout = Layout(config.tensor_parallel, config.pipeline_parallel, config.data_parallel)
        shape = None
        model = sections.get("model")
        read = getattr(model, "config", None)
        if callable(read):
            try:
                shape = shape_from_hf(read())
            except UnsupportedModel as exc:
                problems.append(((), f"model.path {getattr(model, 'path', '?')}: {exc}"))
        problems += [((key,), why) for key, why in layout.problems(shape)]
        if layout.world > 1 and not problems:
            key = next(k for k, v in (("tensor_parallel", config.tensor_parallel),
                                      ("data_parallel", config.data_parallel)) if v > 1)
            problems.append(((key,), (
                f"{layout.describe()}: the trainer daemon runs one rank until it forms a trainer "
                "group across processes (not built yet); use 1")))
        return problems


def megatron_device(environ: Mapping[str, str] = os.environ) -> str:
    """Where the megatron learner trains: the GPU(s) its placement gave it; none given by a
    job that assigns GPUs (CUDA_VISIBLE_DEVICES set, empty): the CPU; a job that assigns
    none: a visible GPU if there is one (as before placement had GPUs), else the CPU
    (megatron/on_cpu.py: slow, but the whole path runs, as CI does)."""
    import torch

    from rlfleet.common.devices import GPU_ENV, torch_device

    device = torch_device(environ)
    if device == "cpu" and GPU_ENV not in environ and torch.cuda.is_available():
        return "cuda"
    return device


def _machine_memory_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001 — no figure, no check
        return None
