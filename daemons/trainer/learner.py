"""The torch learner: the policy, its optimizer, one GRPO step, checkpoints.

Socket-free and etcd-free (the daemon feeds it groups and publishes what it
returns), so it runs in a test exactly as in the daemon.

Versions: the initial model is version 0; each ``train_step`` makes the next
version. A checkpoint is a folder ``step-<version:08d>/`` holding an HF model
(config.json + model.safetensors, loadable by every backend), the tokenizer
files of the original model, ``optimizer.pt``, ``rng.pt`` and, written last,
``trainer_state.json``. It is written under a temporary name and renamed, so a
folder named ``step-*`` is always complete; the newest ``keep`` are kept
(checkpointing.write_checkpoint, shared with the sim backend).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from . import grpo, packing
from .checkpointing import STATE_FILE, CheckpointError, write_checkpoint
from .losses import PolicyLoss
from .step import GroupStep, MicroBatch, micro_batches

log = logging.getLogger("rlfleet.trainer")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "chat_template.jinja", "warmstart.json")


class Learner(GroupStep):
    def __init__(self, model_dir: str | os.PathLike[str], lr: float = 1e-4,
                 loss: PolicyLoss | None = None, seed: int = 0, threads: int = 1, *, temperature: float = 1.0,
                 aggregate: grpo.Aggregate = "token", max_grad_norm: float = 1.0,
                 weight_decay: float = 0.0, micro_batch_tokens: int = 16384,
                 lr_schedule: str = "constant", warmup_steps: int = 0,
                 total_steps: int | None = None, device: str = "cpu") -> None:
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)  # "cuda": the GPU its placement gave it
        self.set_step_options(lr=lr, loss=loss, seed=seed, temperature=temperature, aggregate=aggregate,
                              max_grad_norm=max_grad_norm, weight_decay=weight_decay,
                              micro_batch_tokens=micro_batch_tokens, lr_schedule=lr_schedule,
                              warmup_steps=warmup_steps, total_steps=total_steps)
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.version = 0
        self._load_model(self.model_dir)

    def _load_model(self, path: Path) -> None:
        self.model, self.optimizer = self._build(path)
        config = self.model.config
        self.vocab_size: int = int(config.vocab_size)
        self.hidden_size: int = int(getattr(config, "hidden_size", 1 << 30))
        pad = getattr(config, "pad_token_id", None)
        self.pad_id: int = int(pad) if pad is not None else 0

    def _build(self, path: Path) -> tuple[Any, torch.optim.Optimizer]:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # stderr is the daemon's JSON log
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(self.device)
        model.train()
        # fused: one kernel for all parameters instead of ~10 Python-dispatched ops per
        # tensor; at this model size that is 2.7x less optimizer time per step (TRL's
        # default, "adamw_torch_fused", for the same reason).
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=self.weight_decay,
                                      fused=True)
        return model, optimizer

    # -- training (the step itself: step.py) -----------------------------------------
    def forward_micro_batches(self, batch: grpo.TokenBatch) -> Iterator[MicroBatch]:
        """The batch's rows packed (prompts shared by a group's rows, packing.py), in
        micro-batches of packed rows; per micro-batch the rows' log-probs."""
        packed = packing.pack(batch, batch.prompt_lengths, pad_id=self.pad_id, hidden_size=self.hidden_size)
        dev = self.device
        for prows in micro_batches(packed.widths, self.micro_batch_tokens):
            rows = [n for p in prows for n in packed.source[p]]
            pw = max(packed.widths[p] for p in prows)
            width = max(packed.lengths[n] for n in rows)
            logits = self.model(input_ids=packed.input_ids[prows, :pw].to(dev),
                                position_ids=packed.position_ids[prows, :pw].to(dev),
                                attention_mask=packed.attention[prows, :, :pw, :pw].to(dev)).logits
            logp, entropy = packing.token_logprobs(logits, packed, prows, rows,
                                                   batch.input_ids[rows, 1:width].to(dev), self.temperature,
                                                   entropy_grad=self.loss.needs_entropy_grad)
            yield rows, width, logp, entropy

    @torch.no_grad()
    def sequence_logprob(self, prompt: Sequence[int], completion: Sequence[int]) -> float:
        """log p(completion | prompt) under the current policy (for tests and evals)."""
        ids = torch.tensor([list(prompt) + list(completion)], dtype=torch.long, device=self.device)
        logp, _ = grpo.token_logprobs(self.model(input_ids=ids).logits, ids, self.temperature)
        return float(logp[0, len(prompt) - 1:].sum())

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- publishing -------------------------------------------------------------------
    def hf_state(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    # -- checkpoints ------------------------------------------------------------------
    def save_checkpoint(self, root: str | os.PathLike[str], version: int | None = None,
                        keep: int = 2, extra: dict[str, Any] | None = None) -> Path:
        """Write ``root/step-<version>/`` atomically; keep the newest ``keep``; returns it."""
        version = self.version if version is None else version

        def fill(folder: Path) -> None:
            self.model.save_pretrained(str(folder), safe_serialization=True)
            for name in _TOKENIZER_FILES:
                if (self.model_dir / name).is_file():
                    shutil.copy2(self.model_dir / name, folder / name)
            torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")
            torch.save({"torch": torch.get_rng_state()}, folder / "rng.pt")
            state = {"version": version, "time": time.time(), "lr": self.lr,
                     "lr_schedule": self.lr_schedule, "loss": self.loss.describe(),
                     "seed": self.seed, "base_model": str(self.model_dir), **(extra or {})}
            (folder / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

        return write_checkpoint(root, version, fill, keep)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> int:
        """Restore model, optimizer, RNG and version from a checkpoint folder; returns the version."""
        path = Path(path)
        # Everything is read before anything is replaced: a checkpoint that fails to
        # load leaves this learner as it was (the caller may try an older one).
        part = STATE_FILE
        try:
            state = json.loads((path / STATE_FILE).read_text())
            part = "model"
            model, optimizer = self._build(path)
            part = "optimizer.pt"
            optimizer.load_state_dict(torch.load(path / part, weights_only=True, map_location=self.device))
            part = "rng.pt"
            rng = torch.load(path / part, weights_only=True)
        except Exception as exc:  # torch.load raises anything from IndexError to UnpicklingError
            raise CheckpointError(f"{path}: cannot load {part}: {type(exc).__name__}: {exc}") from exc
        if int(model.config.vocab_size) != self.vocab_size:
            raise CheckpointError(f"{path}: vocabulary {model.config.vocab_size}, "
                                  f"base model {self.vocab_size}")
        self.model, self.optimizer, self.version = model, optimizer, int(state["version"])
        torch.set_rng_state(rng["torch"])
        return self.version

