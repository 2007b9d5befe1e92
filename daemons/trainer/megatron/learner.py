"""The megatron trainer backend: the policy as a megatron-core GPTModel, HF in and out.

``[trainer.backend] kind = "megatron"`` builds a ``MegatronLearner``, which has the learner
interface of ``learner.Learner`` (backends.py) and differs only in the model it trains:

- in: the HF Qwen2 folder (spec ``model.path``); its config.json becomes a megatron-core
  ``TransformerConfig`` (``transformer_config``) and its safetensors the GPTModel's
  weights through ``weights.hf_to_mcore`` (fused qkv, fused gate/up);
- the model: ``GPTModel`` with the *local* layer spec (plain torch modules: no
  TransformerEngine, no apex), RoPE, RMSNorm, SwiGLU, the qkv bias, tied embeddings as
  the config has them; float32 parameters, like the torch learner;
- a step: the same batch (``grpo.build_batch``), the same per-token log-probs, the same
  ``[trainer.loss]`` (POLICY_LOSSES), the same clipping and lr schedule, AdamW; so one
  step from the same weights on the same batch gives the torch learner's result up to
  float summation order (tools/bench/megatron_check.py measures how close);
- out: ``state_tensors()`` are HF-named (``weights.mcore_to_hf``), so the relay
  and every rollout engine load them as they load the torch learner's; a checkpoint is an
  HF model folder like the torch learner's (config.json + model.safetensors + tokenizer),
  loadable by any backend and engine, plus this backend's optimizer state.

Not done: tensor or pipeline parallelism above 1 (one process, one GPU: build refuses it),
megatron's distributed optimizer and DDP wrapper (a torch AdamW over the parameters is the
same update on one GPU), shared-prompt packing (megatron's RoPE takes positions from the
sequence index, not position ids, so rows stay unpacked: one row per turn, causal mask).

Rows are right-padded and the mask is causal, so a padding position never feeds a real
one. The mask is passed explicitly: megatron-core's default causal mask is built on
"cuda" by name, and an explicit one keeps the numerics the same on any device.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rlfleet.common.tensors import to_torch

from .. import grpo
from ..checkpointing import STATE_FILE, CheckpointError, write_checkpoint
from ..learner import _TOKENIZER_FILES
from ..losses import PolicyLoss
from ..step import GroupStep, MicroBatch, micro_batches
from . import weights as mw

BACKEND_NAME = "megatron"
OPTIMIZER_FILE = "optimizer-megatron.pt"  # megatron parameter order: no other backend's file
# The HF files copied beside the weights so a checkpoint is a loadable HF model folder.
_CONFIG_FILES = ("config.json", "generation_config.json")
INSTALL_HINT = ("pip install 'rlfleet[megatron]' (megatron-core 0.19.2 on Python >= 3.12, "
                "0.16.1 on Python 3.11)")


class MegatronUnavailable(RuntimeError):
    """What the megatron backend needs and this process lacks (megatron-core, CUDA, GPUs)."""


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Megatron-core's import and build warnings off: "TransformerEngine/apex not installed"
    (the local spec needs neither) and deprecations of arguments this backend does not pass,
    dozens per model, on the stderr that is the daemon's JSON log."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def megatron_version() -> str:
    """megatron-core's version; MegatronUnavailable (with the install line) without it."""
    try:
        with quiet():
            import megatron.core
    except ImportError as exc:
        raise MegatronUnavailable(f"trainer.backend kind 'megatron' needs megatron-core, "
                                  f"which is not installed ({exc}): {INSTALL_HINT}") from exc
    return str(getattr(megatron.core, "__version__", "unknown"))


def check_device(device: str, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> None:
    """Refuse what this single-process backend cannot run, before megatron is touched."""
    if tensor_parallel * pipeline_parallel != 1:
        raise MegatronUnavailable(
            f"trainer.backend kind 'megatron': tensor_parallel x pipeline_parallel = "
            f"{tensor_parallel} x {pipeline_parallel}; this backend runs one process on one GPU "
            f"(model parallelism needs one process per GPU, not implemented), so both must be 1")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        reason = ("torch was built without CUDA" if torch.version.cuda is None
                  else "no CUDA device is visible")
        raise MegatronUnavailable(
            f"trainer.backend kind 'megatron' needs a CUDA GPU: {reason} (torch "
            f"{torch.__version__}); use kind 'torch' on a machine without one")


def transformer_config(shape: mw.ModelShape, *, tensor_parallel: int = 1,
                       pipeline_parallel: int = 1, dtype: torch.dtype = torch.float32) -> Any:
    """The megatron-core TransformerConfig of an HF Qwen2 shape.

    Every fusion off: the fused kernels come from TransformerEngine/apex or need CUDA
    extensions; plain torch ops give the same function, and the HF model's numerics."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.groups, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn,
        normalization="RMSNorm", layernorm_epsilon=shape.rms_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,  # SwiGLU
        add_bias_linear=False, add_qkv_bias=True,  # Qwen2: bias on q, k, v only
        hidden_dropout=0.0, attention_dropout=0.0,  # Qwen2 trains without dropout
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel,
        params_dtype=dtype, use_cpu_initialization=True, perform_initialization=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False)


def build_gpt_model(shape: mw.ModelShape, config: Any) -> Any:
    """A GPTModel with the local layer spec (needs the model-parallel state initialised)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=shape.vocab, max_sequence_length=shape.max_positions,
                    share_embeddings_and_output_weights=shape.tied,
                    position_embedding_type="rope", rotary_base=int(shape.rope_theta),
                    rotary_percent=1.0)


def ensure_parallel_state(device: str, seed: int, tensor_parallel: int = 1,
                          pipeline_parallel: int = 1) -> None:
    """A process group of one (nccl on a GPU, gloo on CPU) and megatron's parallel state.

    Idempotent: a second learner in the process (a checkpoint load, a test) reuses both."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as tp

    if not dist.is_initialized():
        # A file rendezvous: no port to pick or collide with for a group of one.
        fd, store = tempfile.mkstemp(prefix="rlfleet-megatron-pg-")
        os.close(fd)
        os.unlink(store)
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_parallel, pipeline_parallel)
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device).index or 0)
        if not tp.get_cuda_rng_tracker().is_initialized():
            tp.model_parallel_cuda_manual_seed(seed)


def release_parallel_state() -> None:
    """Undo ensure_parallel_state: megatron's parallel state, then the process group. A
    group left to the interpreter's exit is torn down in an arbitrary order (NCCL warns of
    a leak, and can hang on a GPU); a learner built after this makes both again."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def causal_mask(width: int, device: torch.device | str) -> torch.Tensor:
    """[1, 1, W, W] bool, True where a query may NOT attend (megatron's convention)."""
    return torch.triu(torch.ones(width, width, dtype=torch.bool, device=device), diagonal=1)[None, None]


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """grpo.token_logprobs over [N, W, V] logits of unpacked rows; ``targets`` = ids[:, 1:]
    (``entropy_grad``: entropies carry gradient, as packing.token_logprobs allows)."""
    logp_all = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


class MegatronLearner(GroupStep):
    """learner.Learner's interface over a megatron-core GPTModel (module docstring)."""

    def __init__(self, model_dir: str | os.PathLike[str], lr: float = 1e-4,
                 loss: PolicyLoss | None = None, seed: int = 0, *, temperature: float = 1.0,
                 aggregate: grpo.Aggregate = "token", max_grad_norm: float = 1.0,
                 weight_decay: float = 0.0, micro_batch_tokens: int = 16384,
                 lr_schedule: str = "constant", warmup_steps: int = 0,
                 total_steps: int | None = None, tensor_parallel: int = 1,
                 pipeline_parallel: int = 1, device: str = "cuda") -> None:
        check_device(device, tensor_parallel, pipeline_parallel)
        self.megatron_version = megatron_version()
        self.model_dir = Path(model_dir)
        self.set_step_options(lr=lr, loss=loss, seed=seed, temperature=temperature, aggregate=aggregate,
                              max_grad_norm=max_grad_norm, weight_decay=weight_decay,
                              micro_batch_tokens=micro_batch_tokens, lr_schedule=lr_schedule,
                              warmup_steps=warmup_steps, total_steps=total_steps)
        self.device = torch.device(device)
        self.tensor_parallel, self.pipeline_parallel = tensor_parallel, pipeline_parallel
        hf_config = json.loads((self.model_dir / "config.json").read_text())
        self.shape = mw.shape_from_hf(hf_config)
        self.vocab_size: int = self.shape.vocab
        pad = hf_config.get("pad_token_id")
        self.pad_id: int = int(pad) if pad is not None else 0
        # Not an HF module: evaluation generates with eval_policy()'s HF copy instead.
        self.model = None
        self._eval_model: Any = None
        torch.manual_seed(seed)
        with quiet():
            ensure_parallel_state(device, seed, tensor_parallel, pipeline_parallel)
        self.version = 0
        self.gpt, self.optimizer = self._build(_read_hf_weights(self.model_dir))

    def _build(self, hf: dict[str, torch.Tensor]) -> tuple[Any, torch.optim.Optimizer]:
        config = transformer_config(self.shape, tensor_parallel=self.tensor_parallel,
                                    pipeline_parallel=self.pipeline_parallel)
        with quiet():
            gpt = build_gpt_model(self.shape, config)
        result = gpt.load_state_dict(mw.hf_to_mcore(hf, self.shape), strict=False)
        # _extra_state entries (TransformerEngine's FP8 metadata slots) stay None here.
        missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
        if missing or result.unexpected_keys:
            raise mw.UnsupportedModel(f"megatron model and mapped weights disagree: missing "
                                      f"{missing[:3]}, unexpected {result.unexpected_keys[:3]}")
        gpt.to(self.device).train()
        # fused: one kernel for all parameters, as the torch learner (same update rule).
        optimizer = torch.optim.AdamW(gpt.parameters(), lr=self.lr, weight_decay=self.weight_decay,
                                      fused=True)
        return gpt, optimizer

    def eval_policy(self) -> Any:
        """An HF model with the current weights, for held-out evaluation (evaluation.py):
        generation is HF's. Built once from the model folder, refreshed from state_tensors()
        at each call (the same tensors the relay sends, so it is what rollouts would run)."""
        if self._eval_model is None:
            from transformers import AutoModelForCausalLM

            self._eval_model = AutoModelForCausalLM.from_pretrained(
                str(self.model_dir), dtype=torch.float32).to(self.device).eval()
        state = {name: to_torch(a) for name, a in self.state_tensors().items()}
        result = self._eval_model.load_state_dict(state, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise mw.UnsupportedModel(f"HF model and megatron weights disagree: missing "
                                      f"{result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]}")
        return self._eval_model

    def close(self) -> None:
        """The trainer's worker calls it when it stops (leadership lost, daemon stopping)."""
        self.gpt = self.optimizer = self._eval_model = None
        release_parallel_state()

    # -- training -------------------------------------------------------------------
    def forward_logprobs(self, input_ids: torch.Tensor, entropy_grad: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs and entropies [N, W-1] of right-padded rows [N, W]."""
        ids = input_ids.to(self.device)
        width = ids.shape[1]
        positions = torch.arange(width, device=self.device)[None].expand(ids.shape[0], -1)
        logits = self.gpt(input_ids=ids, position_ids=positions,
                          attention_mask=causal_mask(width, self.device))
        return token_logprobs(logits, ids[:, 1:], self.temperature, entropy_grad)

    # -- training (the step itself: step.py) -----------------------------------------
    def forward_micro_batches(self, batch: grpo.TokenBatch) -> Iterator[MicroBatch]:
        """Unpacked rows in micro-batches; per micro-batch the rows' log-probs on the device."""
        lengths = batch.attention_mask.sum(dim=1).tolist()
        for rows in micro_batches(lengths, self.micro_batch_tokens):
            width = max(lengths[n] for n in rows)
            logp, entropy = self.forward_logprobs(batch.input_ids[rows, :width],
                                                  entropy_grad=self.loss.needs_entropy_grad)
            yield rows, width, logp, entropy

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- publishing -------------------------------------------------------------------
    def hf_state(self) -> dict[str, torch.Tensor]:
        """The weights under the HF model's state_dict names (views of the parameters)."""
        mc = {k: v for k, v in self.gpt.state_dict().items() if not k.endswith("._extra_state")}
        return mw.mcore_to_hf(mc, self.shape)

    # -- checkpoints ------------------------------------------------------------------
    def save_checkpoint(self, root: str | os.PathLike[str], version: int | None = None,
                        keep: int = 2, extra: dict[str, Any] | None = None) -> Path:
        """Write ``root/step-<version>/`` atomically: an HF model folder any backend or
        engine loads, plus this backend's optimizer and RNG state."""
        from safetensors.torch import save_file

        version = self.version if version is None else version

        def fill(folder: Path) -> None:
            # Copies: gate/up (and q/k/v with one group) are views of one fused tensor,
            # and safetensors refuses tensors that share memory.
            tensors = {k: v.detach().to("cpu", torch.float32, copy=True).contiguous()
                       for k, v in self.hf_state().items()
                       if not (self.shape.tied and k == "lm_head.weight")}  # HF omits it too
            save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
            for name in (*_CONFIG_FILES, *_TOKENIZER_FILES):
                if (self.model_dir / name).is_file():
                    shutil.copy2(self.model_dir / name, folder / name)
            torch.save(self.optimizer.state_dict(), folder / OPTIMIZER_FILE)
            rng = {"torch": torch.get_rng_state()}
            if self.device.type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state(self.device)
            torch.save(rng, folder / "rng.pt")
            state = {"version": version, "time": time.time(), "lr": self.lr,
                     "lr_schedule": self.lr_schedule, "loss": self.loss.describe(),
                     "seed": self.seed, "base_model": str(self.model_dir),
                     "backend": BACKEND_NAME, "megatron_core": self.megatron_version, **(extra or {})}
            (folder / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

        return write_checkpoint(root, version, fill, keep)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> int:
        """Restore weights, optimizer, RNG and version; returns the version. Everything is
        read before anything is replaced (a failed load leaves the learner as it was)."""
        path = Path(path)
        part = STATE_FILE
        try:
            state = json.loads((path / STATE_FILE).read_text())
            part = "config.json"
            shape = mw.shape_from_hf(json.loads((path / part).read_text()))
            if shape != self.shape:
                raise CheckpointError(f"{path}: model shape {shape}, base model {self.shape}")
            part = "model.safetensors"
            gpt, optimizer = self._build(_read_hf_weights(path))
            part = OPTIMIZER_FILE
            optimizer.load_state_dict(torch.load(path / part, weights_only=True,
                                                 map_location=self.device))
            part = "rng.pt"
            rng = torch.load(path / part, weights_only=True)
        except CheckpointError:
            raise
        except Exception as exc:  # torch.load raises anything from IndexError to UnpicklingError
            raise CheckpointError(f"{path}: cannot load {part}: {type(exc).__name__}: {exc}") from exc
        self.gpt, self.optimizer, self.version = gpt, optimizer, int(state["version"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        return self.version


def _read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The HF weights of a model folder (one model.safetensors or several shards)."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out
