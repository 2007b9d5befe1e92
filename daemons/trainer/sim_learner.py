"""The sim trainer backend: the learner's interface with a timing model instead of a model.

``[trainer.backend] kind = "sim"`` (backends.py, where the constants and their sources
are). Everything around it is the real trainer: intake, journal, staleness selection,
versions, checkpoints and resume, publishing through the real relay chain. Only the
step itself is modeled:

- ``train_step(groups)`` takes ``time_scale x (fixed_s + tokens / tokens_per_s)`` wall
  seconds, tokens being every prompt and completion token of the batch (each turn that
  generated anything: prompt_token_ids + token_ids, the rows a trainer runs its forward
  and backward over; a turn without generated tokens is no row, as in the torch learner). The
  stats are honest: ``loss`` is 0.0 (there is no model, so no loss to report; a stand-in
  any plot would show as flat), reward_mean/std, trajectories, groups and ``tokens``
  (generated tokens, as the torch learner counts them) come from the batch.
  ``model_step_s`` is the modeled step in model seconds, ``batch_tokens`` the tokens it
  was modeled on, and ``sim_lag_s`` how much longer than modeled the step took in wall
  seconds (an overloaded machine shows here instead of silently slowing the model).
- ``state_tensors()`` returns ``weight_mib`` MiB of fresh float32 arrays whose contents
  are a function of the version alone: each version's bytes differ (the relays carry and
  checksum real, changing data), and publishing the same version again (the trainer's
  republish when starved) sends identical bytes, as the relay requires. Fresh arrays
  each call: a snapshot handed to the publisher is never written again.
- checkpoints are ``step-<version>/trainer_state.json`` alone (checkpointing.py), in the
  same folders and with the same resume rules as the torch learner's.
- ``model`` is None: held-out evaluation needs a policy, so it is off for this backend.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlfleet.common.wire.messages import ScoredTrajectory

from .batching import check_group_sizes
from .checkpointing import STATE_FILE, CheckpointError, write_checkpoint

log = logging.getLogger("rlfleet.trainer")

# Tensors of at most this many MiB (a large model's weights are many tensors; the relay's
# manifest lists each, and chunks cut across them).
TENSOR_MIB = 16


def read_vocab_size(model_dir: str | os.PathLike[str]) -> int:
    """``vocab_size`` from the model folder's config.json (what the intake checks token ids
    against; the sim learner loads no model to ask)."""
    path = Path(model_dir) / "config.json"
    try:
        value = json.loads(path.read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path}: cannot read vocab_size: {exc}") from exc
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{path}: vocab_size must be a positive integer, got {value!r}")
    return value


class SimLearner:
    model = None  # no policy: nothing to evaluate (worker.py turns evaluation off)

    def __init__(self, model_dir: str | os.PathLike[str], *, time_scale: float,
                 tokens_per_s: float, fixed_s: float, weight_mib: int,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """``sleep`` and ``clock`` are the wall clock's (tests pass fakes)."""
        for name, value in (("time_scale", time_scale), ("tokens_per_s", tokens_per_s),
                            ("weight_mib", weight_mib)):
            if not value > 0:
                raise ValueError(f"{name}: must be > 0, got {value}")
        if not fixed_s >= 0:
            raise ValueError(f"fixed_s: must be >= 0, got {fixed_s}")
        self.model_dir = Path(model_dir)
        self.vocab_size = read_vocab_size(self.model_dir)
        self.time_scale, self.tokens_per_s, self.fixed_s = time_scale, tokens_per_s, fixed_s
        self.weight_mib = weight_mib
        self._sleep, self._clock = sleep, clock
        self.version = 0
        sizes = [TENSOR_MIB] * (weight_mib // TENSOR_MIB)
        if weight_mib % TENSOR_MIB:
            sizes.append(weight_mib % TENSOR_MIB)
        # float32 values per tensor
        self._lengths = [mib << 18 for mib in sizes]

    # -- training -------------------------------------------------------------------
    def model_step_s(self, tokens: int) -> float:
        """The modeled duration of a step over ``tokens`` tokens, in model seconds."""
        return self.fixed_s + tokens / self.tokens_per_s

    def train_step(self, groups: Sequence[Sequence[ScoredTrajectory]]) -> dict[str, float]:
        """Sleep one modeled step; returns the torch learner's stats keys, version advanced by one.

        Refuses what the torch learner refuses (ValueError: the loop drops the batch as
        invalid): no group or an empty one, groups of different sizes, no generated token.
        """
        started = self._clock()
        check_group_sizes(groups)
        rewards = np.array([[st.reward for st in g] for g in groups], dtype=np.float64)
        generated = prompt = rows = 0
        for g in groups:
            for st in g:
                for turn in st.trajectory.turns:
                    n = len(turn.token_ids)
                    if n:
                        generated += n
                        prompt += len(turn.prompt_token_ids)
                        rows += 1
        if not generated:
            raise ValueError("no generated tokens in the batch")
        batch_tokens = prompt + generated
        model_s = self.model_step_s(batch_tokens)
        target = self.time_scale * model_s
        remaining = target - (self._clock() - started)
        if remaining > 0:
            self._sleep(remaining)
        step_s = self._clock() - started
        self.version += 1
        return {
            "loss": 0.0,  # no model: nothing to minimise (module docstring)
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "trajectories": int(rewards.size),
            "groups": len(groups),
            "rows": rows,
            "tokens": generated,
            "batch_tokens": batch_tokens,
            "step_s": step_s,
            "model_step_s": model_s,
            "sim_lag_s": max(0.0, step_s - target),
            "version": self.version,
        }

    # -- publishing -------------------------------------------------------------------
    def state_tensors(self, dtype: str = "float32") -> dict[str, np.ndarray]:
        """``weight_mib`` MiB of float32 stamped with the version: fresh arrays, never reused
        (whatever ``dtype``: the sim's size is its own setting, weight_mib).

        Tensor i holds the value ``version + i / 1024`` throughout (exact in float32 up to
        version 2**13 with 1024 tensors; beyond that the bytes still change per version).
        A fill is a memset: ~10 ms for 64 MiB here once the allocator reuses freed pages
        (~150 ms for the first, page-faulted ones), the cost of making real bytes.
        """
        return {f"sim.layers.{i}.weight": np.full(n, self.version + i / 1024, dtype=np.float32)
                for i, n in enumerate(self._lengths)}

    # -- checkpoints ------------------------------------------------------------------
    def save_checkpoint(self, root: str | os.PathLike[str], version: int | None = None,
                        keep: int = 2, extra: dict[str, Any] | None = None) -> Path:
        """``root/step-<version>/trainer_state.json``, atomically; keep the newest ``keep``."""
        version = self.version if version is None else version

        def fill(folder: Path) -> None:
            state = {"version": version, "time": time.time(), "backend": "sim",
                     "base_model": str(self.model_dir), **(extra or {})}
            (folder / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

        return write_checkpoint(root, version, fill, keep)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> int:
        """The version of a checkpoint folder (any backend's: only its version matters here)."""
        path = Path(path)
        try:
            version = json.loads((path / STATE_FILE).read_text())["version"]
        except Exception as exc:  # noqa: BLE001 — unreadable, not JSON, no version
            raise CheckpointError(f"{path}: cannot load {STATE_FILE}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise CheckpointError(f"{path}: {STATE_FILE}: version must be an int >= 0, got {version!r}")
        self.version = version
        return version
