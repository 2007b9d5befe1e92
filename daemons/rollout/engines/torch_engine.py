"""Rollout engines: one interface (add, abort, step, stats, load_weights), and `torch`.

Which engine a rollout runs is the spec's ``[rollout.engine]`` table, built through the
registry (``engines.py``, ``rlfleet.common.spec.seams.ROLLOUT_ENGINES``).

The engine is socket-free (STYLE 8): the daemon's loop feeds it requests between
steps and sends what ``step()`` returns. Every ``add()`` ends as exactly one
GenerateResult, returned by a later ``step()`` (finished, or refused as "error")
or by ``abort()``.

``TorchEngine`` is a slot-based continuous-batching engine over an HF causal LM:

- A KV cache preallocated once: ``[layers, 2, max_batch, kv_heads, max_len, head_dim]``.
  Running requests always occupy rows ``0..n-1`` (a finished row is refilled by
  moving the last row into it), so every forward works on a contiguous view and
  the cache is never gathered or copied per step.
- ``step()`` = one token for every running request and the prefill of the newly
  admitted ones (right padded; each row's positions start at 0), in one forward pass
  (``forward.py``). Requests join and leave between steps.
- A new request whose prompt a running request has (the members of a GRPO group)
  is not prefilled: its row gets a copy of that prompt's keys/values and its first
  token is sampled from that prompt's logits.
- Two forward passes give the same logits: ``LeanForward``, plain torch ops over the
  model's parameters for Llama-style models (Qwen2, Llama), used when it matches the
  model's own forward on a probe at start-up; otherwise ``ModelForward``, the model's
  own layers with per-row position ids, the engine's boolean attention mask, and a
  cache object whose ``update()`` scatters each row's new keys/values at that row's
  positions (``slots.SlotCache``), for decoder-only models whose layers are all
  ``full_attention`` and which use transformers' Cache API (Llama, Qwen2, Mistral
  without sliding window, ...).
- Sampling: temperature 0 is greedy (argmax); otherwise softmax(logits / T),
  restricted to the smallest top-p nucleus, sampled by inverse CDF with one
  uniform draw per token from the request's own ``torch.Generator`` (seeded
  requests are reproducible whatever else is in the batch).
- Log-probs: each reported log-prob is log softmax(logits)[token] at temperature
  1.0 over the full vocabulary, NOT the temperature/top-p distribution the token
  was drawn from. The trainer computes its importance ratios against the
  policy's temperature-1 log-probs, so the behaviour log-probs must be on the
  same scale; a consumer that needs the sampling distribution's probability has
  the request's temperature and top-p to recompute it.
- The EOS token, when sampled, is part of ``token_ids`` (finish_reason "stop"), so
  the trainer sees (and learns) the decision to stop.

Why our own engine (numbers in BENCH_NOTE below): on the tiny model it is as fast
as one plain ``generate`` call, which cannot add or abort requests between steps;
transformers' continuous batching reaches 0.4-0.7x of it with a long-lived manager
(per-step scheduling overhead) and ~1/100 as ``generate_batch`` calls.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlfleet.common.tensors import is_float, to_torch
from rlfleet.common.wire.arrays import Float32Array, Int32Array
from rlfleet.common.wire.messages import EngineStats, GenerateRequest, GenerateResult
from rlfleet.daemons.rollout.engines import api, lean_model
from rlfleet.daemons.rollout.engines.forward import LeanForward, ModelForward, pick_forward
from rlfleet.daemons.rollout.engines.kinds import default_max_len
from rlfleet.daemons.rollout.engines.lean_model import LeanModel
from rlfleet.daemons.rollout.engines.slots import SlotCache, sample

log = logging.getLogger("rlfleet.rollout")

BENCH_NOTE = """\
Tiny Qwen2 (hidden 64, 2 layers, random init), 1 torch thread, 20-token prompts,
64 sampled tokens per request, tokens/s; `python -m rlfleet.tools.bench.rollout_engine
--model DIR --repeats 3` on the 2-core CI machine while other tests ran (load ~5,
contenders interleaved, best round), and (quiet) with load ~1.5:
  batch   TorchEngine     generate    cb_manager   generate_batch
      1     1.1k (1.2k)   0.9k (1.0k)    0.8k          7
      8     4.6k (8.0k)   4.5k (7.3k)    3.1k         39
     32    13.1k (23k)   12.2k (23k)     4.8k        156
generate = one model.generate call (no join/abort between steps); cb_manager =
transformers' continuous batching manager, started once and reused; generate_batch =
the same as one call, set-up included. Kept: TorchEngine.
With the lean forward (forward.py), models/tiny-qwen2 (hidden 96, 3 layers), load ~10,
best of 2: engine 0.24k / 3.9k / 5.6k tok/s at batch 1 / 8 / 32, generate 0.16k / 1.2k /
3.1k. The fleet's pattern (--fleet 200 --step-ms 1: 32 staggered arithmetic requests
per round, groups of 8 sharing a prompt): 23 -> 8.1 CPU-s per 1000 rounds.
"""


# ----------------------------------------------------------------------------- torch engine


@dataclass(eq=False)
class _Seq:
    request: GenerateRequest
    prompt: list[int]
    generator: torch.Generator | None
    version: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached: int = 0  # tokens whose keys/values are in the cache (the last sampled one is not)
    row: int = -1  # its cache row while running
    prompt_logits: torch.Tensor | None = None  # the logits after the prompt (shared by its copies)

    def result(self, reason: str) -> GenerateResult:
        # From the lists directly (stdlib array): the same bytes as through numpy, cheaper.
        return GenerateResult(request_id=self.request.request_id, token_ids=Int32Array(self.tokens),
                              logprobs=Float32Array(self.logprobs), weight_version=self.version,
                              finish_reason=reason)  # type: ignore[arg-type]


class TorchEngine(api.Engine):
    """Continuous batching over an HF causal LM with a preallocated slot KV cache."""

    def __init__(self, model: Any, *, max_batch: int, max_len: int | None = None,
                 eos_token_ids: set[int] | None = None, max_prefill_tokens: int = 8192,
                 weight_version: int = 0, seed: int | None = None, lean: bool = True) -> None:
        config = model.config
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise ValueError(f"TorchEngine supports full-attention layers only, model has {sorted(layer_types)}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model.eval()
        self.base = model.base_model
        self.head = model.get_output_embeddings()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = int(config.vocab_size)
        self.max_batch = max_batch
        self.max_len = int(max_len or default_max_len(config))
        self.max_prefill_tokens = max_prefill_tokens
        self.eos = eos_token_ids if eos_token_ids is not None else _eos_ids(model)
        self.weight_version = weight_version
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.cache = SlotCache(config.num_hidden_layers, max_batch, kv_heads, self.max_len,
                                head_dim, self.dtype, self.device)
        self._shared_gen = torch.Generator().manual_seed(
            seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        self.running: list[_Seq] = []  # index = cache row
        # The running requests of each distinct prompt: a new request with the same prompt (a
        # GRPO group's members) copies its prompt's keys/values instead of computing them again.
        self._by_prompt: dict[tuple[int, ...], list[_Seq]] = {}
        self.waiting: deque[GenerateRequest] = deque()
        self._answers: list[GenerateResult] = []  # refused requests, handed out by step()
        self._ids: set[str] = set()  # request ids waiting or running
        self._token_rate = api.TokenRate()
        if isinstance(model, LeanModel):  # parameters only: the lean pass is its forward
            self.forward: ModelForward | LeanForward = LeanForward(model, self.cache, self.max_len)
        else:
            self._check_logits_path()
            self.forward = pick_forward(model, self.cache, self.max_len, self.max_batch, lean)
        # After _pick_forward: the lean pass re-points some parameters at fused tensors.
        # Listed once: walking the module tree cost more than the copies (a load per
        # training step).
        aliases = _param_aliases(model)
        self._state_names = set(model.state_dict())  # params, tied aliases, persistent buffers
        self._params = [(name, [a for a, c in aliases.items() if c == name], param)
                        for name, param in model.named_parameters()]
        self._buffers = [(name, buf) for name, buf in model.named_buffers() if name in self._state_names]

    @classmethod
    def from_pretrained(cls, path: str | Path, *, max_batch: int, max_len: int | None = None,
                        dtype: str = "float32", device: str = "cpu", **kwargs: Any) -> TorchEngine:
        """A plain Qwen2/Llama checkpoint loads without transformers (``lean_model``: ~2.3
        CPU-s less per start); any other, or with ``lean=False``, through transformers."""
        model = None
        if kwargs.get("lean", True):
            model = lean_model.load(path, getattr(torch, dtype), device)
        if model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype),
                                                         attn_implementation="sdpa").to(device)
        return cls(model, max_batch=max_batch, max_len=max_len, **kwargs)

    @torch.inference_mode()
    def _check_logits_path(self) -> None:
        # The engine computes logits as head(base(...)) to project only the positions it
        # samples from; refuse an architecture that post-processes logits (soft-capping, scaling).
        ids = torch.tensor([[0, 1, 2]], device=self.device) % self.vocab_size
        full = self.model(input_ids=ids).logits.float()
        mine = self.head(self.base(input_ids=ids).last_hidden_state).float()
        if not torch.allclose(full, mine, atol=1e-4, rtol=1e-4):
            raise ValueError(f"{type(self.model).__name__}: logits are not lm_head(hidden states); "
                             "TorchEngine does not support this architecture")

    # -- requests ---------------------------------------------------------------------
    def add(self, request: GenerateRequest) -> None:
        try:
            self._validate(request)
        except api.BadRequest as exc:
            self._answers.append(api.error_result(request, str(exc), self.weight_version))
            return
        self._ids.add(request.request_id)
        self.waiting.append(request)

    def _validate(self, r: GenerateRequest) -> None:
        api.validate_request(r, known_ids=self._ids, vocab_size=self.vocab_size, capacity=self.max_len,
                             capacity_name="the cache length")

    def abort(self, request_id: str) -> GenerateResult | None:
        if request_id not in self._ids:
            return None
        self._ids.discard(request_id)
        for i, req in enumerate(self.waiting):
            if req.request_id == request_id:
                del self.waiting[i]
                return GenerateResult(request_id=request_id, token_ids=Int32Array(),
                                      logprobs=Float32Array(), weight_version=self.weight_version,
                                      finish_reason="abort")
        row = next(i for i, s in enumerate(self.running) if s.request.request_id == request_id)
        seq = self.running[row]
        self._free_rows([row])
        return seq.result("abort")

    def has_running(self) -> bool:
        return bool(self.running)

    def running_ids(self) -> list[str]:
        return [s.request.request_id for s in self.running]

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._answers)

    def stats(self) -> EngineStats:
        return EngineStats(weight_version=self.weight_version, running=len(self.running),
                           waiting=len(self.waiting), kv_used=sum(s.cached for s in self.running),
                           kv_total=self.max_batch * self.max_len,
                           tokens_per_s=self._token_rate.per_s())

    # -- the step ---------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[GenerateResult]:
        out, self._answers = self._answers, []
        decoding = len(self.running)
        admitted = self._admit()
        if decoding or admitted:
            self._advance(decoding, admitted)
            self._token_rate.add(decoding + len(admitted))
        out += self._collect_finished()
        return out

    def _admit(self) -> list[_Seq]:
        free = self.max_batch - len(self.running)
        new: list[_Seq] = []
        budget = self.max_prefill_tokens
        while self.waiting and len(new) < free:
            req = self.waiting[0]
            n = req.prompt_token_ids.size
            if new and n > budget:
                break  # a long prompt waits for the next step rather than stall decoding
            self.waiting.popleft()
            budget -= n
            gen = None
            if req.seed is not None:
                gen = torch.Generator().manual_seed(req.seed)
            new.append(_Seq(req, req.prompt_token_ids.tolist(), gen, self.weight_version))
        return new

    def _advance(self, decoding: int, new: list[_Seq]) -> None:
        """One token for each of the first ``decoding`` running rows and each new request:
        one forward pass, which also prefills the new prompts not already in the cache.

        A new request whose prompt a running (or another new) request has is a copy: its
        rows get that prompt's keys/values by one cache copy, and its first token is
        sampled from that prompt's logits. Rows: decoding, then prefilled, then copies."""
        dev = self.device
        seqs = self.running[:decoding]
        dec_ids = torch.tensor([s.tokens[-1] for s in seqs], dtype=torch.long, device=dev)
        dec_pos = torch.tensor([s.cached for s in seqs], dtype=torch.long, device=dev)
        pre_ids = pre_last = None
        fresh: list[_Seq] = []
        copies: list[tuple[_Seq, _Seq]] = []  # (copy, the request whose prompt it copies)
        for s in new:
            holders = self._by_prompt.setdefault(tuple(s.prompt), [])
            if holders:
                copies.append((s, holders[0]))
            else:
                fresh.append(s)
            holders.append(s)
        if fresh:
            lengths = [len(s.prompt) for s in fresh]
            width = max(lengths)
            # Right padded; padded positions only feed padded queries (causal from 0), and
            # decode overwrites those cache slots before any real query reads them.
            pre_ids = torch.tensor([s.prompt + [0] * (width - len(s.prompt)) for s in fresh],
                                   dtype=torch.long, device=dev)
            pre_last = torch.tensor([n - 1 for n in lengths], dtype=torch.long, device=dev)
        order = seqs + fresh
        order += [c for c, _ in copies]
        for row in range(decoding, len(order)):
            order[row].row = row
        self.running = order
        logits = self.forward(dec_ids, dec_pos, pre_ids, pre_last)
        for s in seqs:
            s.cached += 1
        for i, s in enumerate(fresh):
            s.cached = len(s.prompt)
            s.prompt_logits = logits[decoding + i]
        if copies:
            self.cache.copy_rows([src.row for _, src in copies], decoding + len(fresh),
                                 max(len(c.prompt) for c, _ in copies))
            for c, src in copies:
                c.cached, c.prompt_logits = len(c.prompt), src.prompt_logits
            logits = torch.cat([logits, torch.stack([c.prompt_logits for c, _ in copies])])
        self._sample(order, logits)

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        tokens, logprobs = sample(logits, [s.request for s in seqs], [s.generator for s in seqs],
                                  self._shared_gen)
        for s, tok, lp in zip(seqs, tokens, logprobs):
            s.tokens.append(tok)
            s.logprobs.append(lp)

    def _collect_finished(self) -> list[GenerateResult]:
        done: list[tuple[int, str]] = []
        for row, s in enumerate(self.running):
            if s.tokens[-1] in self.eos:
                done.append((row, "stop"))
            elif len(s.tokens) >= s.request.max_new_tokens:
                done.append((row, "length"))
        results = [self.running[row].result(reason) for row, reason in done]
        self._free_rows([row for row, _ in done])
        for r in results:
            self._ids.discard(r.request_id)
        return results

    def _free_rows(self, rows: list[int]) -> None:
        """Remove rows, keeping the running rows contiguous (the last row fills the hole)."""
        for row in sorted(rows, reverse=True):
            gone = self.running[row]
            key = tuple(gone.prompt)
            holders = self._by_prompt[key]
            holders.remove(gone)
            if not holders:
                del self._by_prompt[key]
            last = len(self.running) - 1
            if row != last:
                moved = self.running[last]
                self.cache.move_row(last, row, moved.cached)
                self.running[row] = moved
                moved.row = row
            self.running.pop()

    # -- weights ----------------------------------------------------------------------
    def load_weights(self, version: int, tensors: Mapping[str, np.ndarray]) -> None:
        """Copy a full state dict (HF names) into the model; all-or-nothing.

        Every parameter must be present (under its name or a tied alias such as
        lm_head.weight), floating point, with its exact shape; persistent buffers are
        taken when sent; unknown names are refused. Nothing is copied unless all pass.
        """
        if self.running:
            raise RuntimeError(f"load_weights with {len(self.running)} running request(s): "
                               "a version may change only between requests")
        unknown = sorted(set(tensors) - self._state_names)
        if unknown:
            raise ValueError(f"unknown tensor name(s): {unknown[:5]}")
        plan: list[tuple[torch.Tensor, np.ndarray]] = []
        for name, aliases, param in self._params:
            src_name = next((a for a in aliases if a in tensors), None)
            if src_name is None:
                raise ValueError(f"missing tensor {name!r} for version {version}")
            plan.append((param, tensors[src_name]))
        for name, buf in self._buffers:  # persistent buffers: taken if sent
            if name in tensors:
                plan.append((buf, tensors[name]))
        for dst, arr in plan:
            if tuple(arr.shape) != tuple(dst.shape) or not is_float(arr):
                name = next(n for n, a in tensors.items() if a is arr)
                raise ValueError(f"{name}: shape {tuple(arr.shape)} dtype {np.asarray(arr).dtype}, "
                                 f"model has shape {tuple(dst.shape)} (floating point)")
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # from_numpy of a read-only view: we only read it
            for param, arr in plan:
                param.copy_(to_torch(arr))  # to the engine's dtype (a bfloat16 version into float32, too)
        self.weight_version = version


def _eos_ids(model: Any) -> set[int]:
    ids: set[int] = set()
    for cfg in (getattr(model, "generation_config", None), model.config):
        eos = getattr(cfg, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    return ids


def _param_aliases(model: Any) -> dict[str, str]:
    """state_dict name -> the parameter it sets (tied weights have several names)."""
    by_ptr = {p.data_ptr(): n for n, p in model.named_parameters()}
    aliases = {}
    for name, tensor in model.state_dict().items():
        canonical = by_ptr.get(tensor.data_ptr())
        if canonical is not None:
            aliases[name] = canonical
    return aliases
