"""The megatron trainer backend: the policy as a megatron-core GPTModel, HF in and out.

``[trainer.backend] kind = "megatron"`` builds a ``MegatronLearner``, which has the learner
interface of ``learner.Learner`` (backends.py) and differs only in the model it trains:

- in: the HF Qwen2 folder (spec ``model.path``); its config.json becomes a megatron-core
  ``TransformerConfig`` (``transformer_config``) and its safetensors the GPTModel's
  weights through ``weights.hf_to_mcore`` (fused qkv, fused gate/up);
- the model: ``GPTModel`` with the *local* layer spec (plain torch modules: no
  TransformerEngine, no apex), RoPE, RMSNorm, SwiGLU, the qkv bias, tied embeddings as
  the config has them; float32 parameters, like the torch learner;
- the parallel layout (layout.py): this process is one rank of tensor x data parallel
  ranks (megatron-core's ``parallel_state``); it loads its tensor-parallel slice of the HF
  weights (read_hf_slice: only its slice is read), trains through megatron-core's ``DistributedDataParallel``
  (gradients reduced across data-parallel ranks) and its distributed optimizer (Adam
  state and float32 master weights sharded across them), with gradient clipping by the
  global norm (megatron's). With one rank all of it is the identity;
- a step: the same batch (``grpo.build_batch``), the same per-token log-probs, the same
  ``[trainer.loss]`` (POLICY_LOSSES), the same clipping and lr schedule, AdamW; so one
  step from the same weights on the same batch gives the torch learner's result up to
  float summation order (tools/bench/megatron_check.py measures how close). Each
  data-parallel rank takes its share of the batch's rows; the loss keeps the whole
  batch's denominator, so the summed gradients are the one-rank step's;
- out: ``state_tensors()`` are HF-named (``weights.mcore_to_hf``), so the relay
  and every rollout engine load them as they load the torch learner's; a checkpoint is
  megatron's distributed checkpoint (``distcp/``: weights and optimizer, loadable at
  another layout) in a folder with the config and tokenizer, and with one rank also an HF
  model folder (model.safetensors) like the torch learner's, loadable by any backend and
  engine.

Not done: pipeline parallelism (layout.py refuses it); the daemon forming a group of ranks (to
come): a multi-rank learner is built today by processes that formed their
torch.distributed group themselves (the tests, torchrun). Shared-prompt packing: megatron's
RoPE takes positions from the sequence index, not position ids, so rows stay unpacked (one
row per turn, causal mask). Logits are gathered across tensor-parallel ranks (the full
vocabulary per rank, as one rank has; a vocabulary-parallel log-softmax would save it).
Weight decay, when set, skips biases and norms (megatron's default; the torch learner
decays every parameter).

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
from ..batching import NonFiniteStep
from ..checkpointing import STATE_FILE, CheckpointError, write_checkpoint
from ..guard import require_finite, weights_finite
from ..learner import _TOKENIZER_FILES
from ..losses import PolicyLoss
from ..step import GroupStep, MicroBatch, micro_batches
from . import compat, on_cpu
from . import weights as mw
from .layout import Layout

BACKEND_NAME = "megatron"
# float32: like the torch learner. bfloat16: bf16 parameters and compute, float32 master
# weights and optimizer state (megatron's mixed precision); log-probs in float32 either way.
PRECISIONS = ("float32", "bfloat16")
# megatron's distributed checkpoint (torch.distributed.checkpoint files): the weights and the
# optimizer, every tensor named by its place in the whole model, so any layout loads it.
DISTCP = "distcp"
# The optimizer's state in model space, gathered per data-parallel group over gloo while
# saving ("mem_efficient"): loadable at another tensor or data parallel size.
RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable",
               "distrib_optim_fully_reshardable_mem_efficient": True}
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


def check_device(device: str, layout: Layout, shape: mw.ModelShape | None = None) -> None:
    """Refuse what this backend cannot run, before megatron is touched."""
    problems = layout.problems(shape)
    if problems:
        raise MegatronUnavailable("trainer.backend kind 'megatron': " + "; ".join(
            f"{key} {why}" for key, why in problems))
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
        # The loss is already divided by the whole batch's denominator (step.py), so the
        # data-parallel ranks' gradients are summed, not averaged (DDP's scaling factor 1).
        calculate_per_token_loss=True,
        # bf16: bfloat16 parameters and compute; the distributed optimizer keeps float32
        # master weights and Adam state (megatron's mixed precision).
        params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True, perform_initialization=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False)


def build_gpt_model(shape: mw.ModelShape, config: Any) -> Any:
    """A GPTModel with the local layer spec (needs the model-parallel state initialised);
    its logits are whole (gathered across tensor-parallel ranks: ``parallel_output``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                   vocab_size=shape.vocab, max_sequence_length=shape.max_positions,
                   share_embeddings_and_output_weights=shape.tied,
                   position_embedding_type="rope", rotary_base=int(shape.rope_theta),
                   rotary_percent=1.0, parallel_output=False)
    mark_tensor_parallel(gpt)
    return gpt


def mark_tensor_parallel(gpt: Any) -> None:
    """Tag each split weight as megatron's initialisers would have. megatron-core 0.16.1
    tags a parallel layer's weight only when it initialises it; built without
    (``perform_initialization=False``, the HF weights are loaded instead), the gradient
    norm took every untagged weight for a copy and counted it on tensor-parallel rank 0
    only (TP 2 reported 0.81 of the true norm, found by test_megatron_parallel.py)."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in gpt.modules():
        weight = getattr(module, "weight", None)
        if weight is None or getattr(weight, "tensor_model_parallel", False):
            continue
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=0, stride=1)
        elif isinstance(module, RowParallelLinear):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=1, stride=1)


def ensure_parallel_state(device: str, seed: int, layout: Layout | None = None) -> None:
    """Megatron's parallel state over this process's torch.distributed group; a group of
    one (nccl on a GPU, gloo on CPU) made here when the layout is one rank and there is none.

    Idempotent: a second learner in the process (a checkpoint load, a test) reuses both."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as tp

    layout = layout or Layout()
    if torch.device(device).type == "cpu":
        on_cpu.install()
    if dist.is_initialized():
        if dist.get_world_size() != layout.world:
            raise MegatronUnavailable(f"the layout {layout.describe()}, but this process group has "
                                      f"{dist.get_world_size()} ranks")
    elif layout.world != 1:
        raise MegatronUnavailable(f"the layout {layout.describe()}: this process must join the "
                                  f"trainer's torch.distributed group first (one process per rank)")
    else:
        # A file rendezvous: no port to pick or collide with for a group of one.
        fd, store = tempfile.mkstemp(prefix="rlfleet-megatron-pg-")
        os.close(fd)
        os.unlink(store)
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(layout.tensor, layout.pipeline)
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
    """learner.Learner's interface over one rank of a megatron-core GPTModel (module docstring)."""

    def __init__(self, model_dir: str | os.PathLike[str], lr: float = 1e-4,
                 loss: PolicyLoss | None = None, seed: int = 0, *, temperature: float = 1.0,
                 aggregate: grpo.Aggregate = "token", max_grad_norm: float = 1.0,
                 weight_decay: float = 0.0, micro_batch_tokens: int = 16384,
                 lr_schedule: str = "constant", warmup_steps: int = 0,
                 total_steps: int | None = None, tensor_parallel: int = 1,
                 pipeline_parallel: int = 1, data_parallel: int = 1, device: str = "cuda",
                 precision: str = "float32") -> None:
        self.model_dir = Path(model_dir)
        hf_config = json.loads((self.model_dir / "config.json").read_text())
        self.shape = mw.shape_from_hf(hf_config)
        self.layout = Layout(tensor_parallel, pipeline_parallel, data_parallel)
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
        self.precision = precision
        check_device(device, self.layout, self.shape)
        self.megatron_version = megatron_version()
        self.set_step_options(lr=lr, loss=loss, seed=seed, temperature=temperature, aggregate=aggregate,
                              max_grad_norm=max_grad_norm, weight_decay=weight_decay,
                              micro_batch_tokens=micro_batch_tokens, lr_schedule=lr_schedule,
                              warmup_steps=warmup_steps, total_steps=total_steps)
        self.device = torch.device(device)
        self.vocab_size: int = self.shape.vocab
        pad = hf_config.get("pad_token_id")
        self.pad_id: int = int(pad) if pad is not None else 0
        # Not an HF module: evaluation generates with eval_policy()'s HF copy instead.
        self.model = None
        self._eval_model: Any = None
        torch.manual_seed(seed)
        with quiet():
            ensure_parallel_state(device, seed, self.layout)
        from megatron.core import parallel_state as ps

        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_group = ps.get_data_parallel_group()
        self.version = 0
        self.gpt, self.ddp, self.optimizer = self._build(self._read_base_model())

    def _read_base_model(self) -> dict[str, torch.Tensor]:
        return read_hf_slice(self.model_dir, self.layout.tensor, self.tp_rank)

    def _build(self, hf: dict[str, torch.Tensor]) -> tuple[Any, Any, Any]:
        """This rank's slice of the HF weights in a GPTModel, wrapped in megatron-core's DDP,
        with megatron-core's distributed optimizer over it."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        compat.install()
        tp = self.layout.tensor
        bf16 = self.precision == "bfloat16"
        config = transformer_config(self.shape, tensor_parallel=tp, pipeline_parallel=self.layout.pipeline,
                                    dtype=torch.bfloat16 if bf16 else torch.float32)
        with quiet():
            gpt = build_gpt_model(self.shape, config)
        mine = mw.hf_to_mcore(hf, mw.local_shape(self.shape, tp))
        result = gpt.load_state_dict(mine, strict=False)
        # _extra_state entries (TransformerEngine's FP8 metadata slots) stay None here.
        missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
        if missing or result.unexpected_keys:
            raise mw.UnsupportedModel(f"megatron model and mapped weights disagree: missing "
                                      f"{missing[:3]}, unexpected {result.unexpected_keys[:3]}")
        gpt.to(self.device).train()
        # bf16: megatron's Float16Module casts every parameter (the norms too) and the
        # float inputs to bf16, and the logits back to float32, as megatron's training does.
        model = gpt
        if bf16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, gpt)
        # Gradients reduced once per step after every micro-batch (no overlap: the step's
        # time is honest, and gloo has no streams to overlap on); in float32 always.
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                                   overlap_grad_reduce=False)
        with quiet(), on_cpu.cuda_type_names():
            ddp = DistributedDataParallel(config, ddp_config, model)
            # Adam is torch's AdamW where apex/TransformerEngine are absent (megatron's
            # fallback), the update rule of the torch learner; the lr is set per step.
            optimizer = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=self.lr, weight_decay=self.weight_decay, adam_beta1=0.9,
                adam_beta2=0.999, adam_eps=1e-8, clip_grad=self.max_grad_norm,
                use_distributed_optimizer=True, bf16=bf16, fp16=False), [ddp])
        return gpt, ddp, optimizer

    def eval_policy(self) -> Any:
        """An HF model with the current weights, for held-out evaluation (evaluation.py):
        generation is HF's. Built once from the model folder, refreshed from state_tensors()
        at each call (the same tensors the relay sends, so it is what rollouts would run)."""
        self._require_one_rank("held-out evaluation")
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

    def _require_one_rank(self, what: str) -> None:
        if self.layout.world != 1:
            raise MegatronUnavailable(f"{what} of a multi-rank megatron trainer ({self.layout.describe()}) "
                                      "is not built yet")

    def close(self) -> None:
        """The trainer's worker calls it when it stops (leadership lost, daemon stopping)."""
        self.gpt = self.ddp = self.optimizer = self._eval_model = None
        release_parallel_state()

    # -- training -------------------------------------------------------------------
    def forward_logprobs(self, input_ids: torch.Tensor, entropy_grad: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs and entropies [N, W-1] of right-padded rows [N, W]."""
        ids = input_ids.to(self.device)
        width = ids.shape[1]
        positions = torch.arange(width, device=self.device)[None].expand(ids.shape[0], -1)
        logits = self.ddp(input_ids=ids, position_ids=positions,
                          attention_mask=causal_mask(width, self.device))
        return token_logprobs(logits, ids[:, 1:], self.temperature, entropy_grad)

    # -- training (the step itself: step.py) -----------------------------------------
    def forward_micro_batches(self, batch: grpo.TokenBatch) -> Iterator[MicroBatch]:
        """This data-parallel rank's rows (rows_of_rank) in micro-batches; per micro-batch
        the rows' log-probs on the device."""
        lengths = batch.attention_mask.sum(dim=1).tolist()
        mine = rows_of_rank(lengths, self.layout.data, self.dp_rank)
        for chunk in micro_batches([lengths[n] for n in mine], self.micro_batch_tokens):
            rows = [mine[i] for i in chunk]
            width = max(lengths[n] for n in rows)
            logp, entropy = self.forward_logprobs(batch.input_ids[rows, :width],
                                                  entropy_grad=self.loss.needs_entropy_grad)
            yield rows, width, logp, entropy

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def apply_update(self, losses: list[torch.Tensor], lr: float) -> tuple[float, float]:
        """guard.apply_update's contract over every rank at once: the gradients reduced
        across data-parallel ranks, the whole batch's loss and the global gradient norm
        checked (the same verdict on every rank: both are reduced first), megatron's
        clipped update, then the weights checked on every rank."""
        import torch.distributed as dist

        local = torch.stack([x.detach().float() for x in losses]).sum() if losses else torch.zeros(())
        total = local.to(self.device).reshape(1)
        dist.all_reduce(total, group=self.dp_group)  # tensor-parallel ranks share their loss
        self.ddp.finish_grad_sync()
        try:
            require_finite("loss", total)
            self.optimizer.prepare_grads()
            grad_norm = torch.tensor([float(self.optimizer.get_grad_norm())])
            require_finite("gradient norm", grad_norm)
        except NonFiniteStep:
            self.zero_grad()
            raise
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with on_cpu.cuda_type_names():
            self.optimizer.step()  # clips by the global norm, updates, gathers the new weights
        finite = torch.tensor([1.0 if weights_finite(list(self.gpt.parameters())) else 0.0],
                              device=self.device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not bool(finite.item()):
            raise NonFiniteStep(f"weights not finite after the update (loss {float(total)!r}, "
                                f"gradient norm {float(grad_norm)!r})", weights_touched=True)
        return float(total), float(grad_norm)

    def gather_stats(self, parts: list[dict[str, float]]) -> list[dict[str, float]]:
        """Every data-parallel rank's micro-batch stats (each rank saw its rows only)."""
        if self.layout.data == 1:
            return parts
        import torch.distributed as dist

        everyone: list[Any] = [None] * self.layout.data
        dist.all_gather_object(everyone, parts, group=self.dp_group)
        return [p for rank_parts in everyone for p in rank_parts]

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- publishing -------------------------------------------------------------------
    def hf_state(self) -> dict[str, torch.Tensor]:
        """This rank's weights under the HF model's state_dict names (views of the
        parameters): whole with one tensor-parallel rank, else this rank's slice of each
        split tensor (weights.split_dim says which; weights.hf_join puts them together)."""
        mc = {k: v for k, v in self.gpt.state_dict().items() if not k.endswith("._extra_state")}
        return mw.mcore_to_hf(mc, mw.local_shape(self.shape, self.layout.tensor))

    # -- checkpoints ------------------------------------------------------------------
    def _sharded_state(self, loading: bool, optimizer: bool) -> dict[str, Any]:
        """The model and (``optimizer``) the optimizer as megatron's sharded state dict,
        every tensor named by its place in the whole model (so any layout can load it).
        Before the first step there is no optimizer state to save (megatron cannot describe
        an empty one): the checkpoint then holds the model alone."""
        if loading and optimizer:  # megatron's optimizer state_dict needs a state to describe
            for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                o._init_optimizer_states_with_dummy_values()
        with on_cpu.cuda_type_names():
            out: dict[str, Any] = {"model": self.gpt.sharded_state_dict(),
                                   "adam_step": compat.adam_step(self.optimizer)}
            if optimizer:
                out["optimizer"] = self.optimizer.sharded_state_dict(out["model"], is_loading=loading,
                                                                     metadata=RESHARDABLE)
        return out

    def save_checkpoint(self, root: str | os.PathLike[str], version: int | None = None,
                        keep: int = 2, extra: dict[str, Any] | None = None) -> Path:
        """``root/step-<version>/``, written by every rank together (a collective: each
        rank calls it) and renamed into place by rank 0: ``distcp/``, megatron's distributed
        checkpoint of the weights and the optimizer (float32 master weights, Adam's moments),
        loadable at another layout; with one rank also the HF weights (``model.safetensors``),
        so the folder is an HF model any backend or engine loads. ``root`` must be a folder
        every rank reaches (megatron's assumption too). Returns the folder (rank 0's path on
        every rank)."""
        import torch.distributed as dist
        from megatron.core import dist_checkpointing
        from safetensors.torch import save_file

        version = self.version if version is None else version
        root = Path(root)
        staging = root / f".tmp-step-{version:08d}-ranks"
        rank0 = dist.get_rank() == 0
        if rank0:
            shutil.rmtree(staging, ignore_errors=True)
            (staging / DISTCP).mkdir(parents=True)
        dist.barrier()
        stepped = compat.adam_step(self.optimizer) > 0
        with quiet():
            dist_checkpointing.save(self._sharded_state(loading=False, optimizer=stepped), str(staging / DISTCP))
        dist.barrier()
        final = root / f"step-{version:08d}"
        if not rank0:
            return final

        def fill(folder: Path) -> None:
            os.rename(staging / DISTCP, folder / DISTCP)
            if self.layout.world == 1:
                # Copies: gate/up (and q/k/v with one group) are views of one fused tensor,
                # and safetensors refuses tensors that share memory.
                tensors = {k: v.detach().to("cpu", torch.float32, copy=True).contiguous()
                           for k, v in self.hf_state().items()
                           if not (self.shape.tied and k == "lm_head.weight")}  # HF omits it too
                save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
            for name in (*_CONFIG_FILES, *_TOKENIZER_FILES):
                if (self.model_dir / name).is_file():
                    shutil.copy2(self.model_dir / name, folder / name)
            rng = {"torch": torch.get_rng_state()}
            if self.device.type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state(self.device)
            torch.save(rng, folder / "rng.pt")
            state = {"version": version, "time": time.time(), "lr": self.lr,
                     "lr_schedule": self.lr_schedule, "loss": self.loss.describe(),
                     "seed": self.seed, "base_model": str(self.model_dir),
                     "backend": BACKEND_NAME, "megatron_core": self.megatron_version,
                     "precision": self.precision, "layout": self.layout.describe(),
                     "optimizer_state": stepped, **(extra or {})}
            (folder / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

        try:
            return write_checkpoint(root, version, fill, keep)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> int:
        """Restore weights, optimizer, RNG and version from a checkpoint of any layout (a
        collective: every rank calls it); returns the version. Everything is read into a
        new model before anything is replaced (a failed load leaves the learner as it was)."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        part = STATE_FILE
        current = self.gpt, self.ddp, self.optimizer
        try:
            state = json.loads((path / STATE_FILE).read_text())
            part = "config.json"
            shape = mw.shape_from_hf(json.loads((path / part).read_text()))
            if shape != self.shape:
                raise CheckpointError(f"{path}: model shape {shape}, base model {self.shape}")
            if state.get("precision", "float32") != self.precision:
                raise CheckpointError(f"{path}: trained in {state.get('precision', 'float32')}, "
                                      f"this learner trains in {self.precision}")
            part = "rng.pt"
            rng = torch.load(path / part, weights_only=True)
            part = DISTCP
            if not (path / DISTCP / "metadata.json").is_file():
                raise FileNotFoundError(f"no {DISTCP}/ (not a megatron checkpoint of this format)")
            # The base model's weights build the structure; the checkpoint replaces them all.
            self.gpt, self.ddp, self.optimizer = self._build(self._read_base_model())
            stepped = bool(state.get("optimizer_state", True))
            with quiet():
                loaded = dist_checkpointing.load(self._sharded_state(loading=True, optimizer=stepped),
                                                 str(path / DISTCP))
            with on_cpu.cuda_type_names():
                result = self.gpt.load_state_dict(loaded["model"], strict=False)
                missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
                if missing:
                    raise CheckpointError(f"{path}: {DISTCP} lacks {missing[:3]}")
                if stepped:
                    self.optimizer.load_state_dict(loaded["optimizer"])
                    compat.set_adam_step(self.optimizer, float(loaded["adam_step"]))
        except Exception as exc:  # torch.load raises anything from IndexError to UnpicklingError
            self.gpt, self.ddp, self.optimizer = current
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{path}: cannot load {part}: {type(exc).__name__}: {exc}") from exc
        self.version = int(state["version"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        return self.version


def rows_of_rank(lengths: list[int], ranks: int, rank: int) -> list[int]:
    """The batch rows data-parallel rank ``rank`` of ``ranks`` trains, in batch order:
    longest first to the rank with the fewest tokens so far (ties to the lower rank), so
    every rank computes the same split and the ranks' token counts stay close."""
    if ranks == 1:
        return list(range(len(lengths)))
    load = [0] * ranks
    owner = [0] * len(lengths)
    for n in sorted(range(len(lengths)), key=lambda n: (-lengths[n], n)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[n] = r
        load[r] += lengths[n]
    return [n for n in range(len(lengths)) if owner[n] == rank]


def read_hf_slice(folder: Path, tensor_parallel: int = 1, rank: int = 0) -> dict[str, torch.Tensor]:
    """A tensor-parallel rank's slice of the HF weights of a model folder (one
    model.safetensors or several shards), read as a slice: no rank holds the whole model
    in memory (at the 0.5B shape in float32, 2 GB a rank would read and drop)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 — safe_open is not a mapping
                dim = mw.split_dim(name)
                if dim is None or tensor_parallel == 1:
                    out[name] = st.get_tensor(name)
                    continue
                part = st.get_slice(name)
                size = part.get_shape()[dim] // tensor_parallel
                span = slice(rank * size, (rank + 1) * size)
                out[name] = part[span] if dim == 0 else part[:, span]
    return out
