"""The rollout-engine seam: the spec table ``[rollout.engine]`` of each engine kind.

Registered in pyproject.toml (``rlfleet.rollout_engines``). This module is imported
whenever a spec is validated, so it holds configs only; ``build`` imports torch.
The engine interface itself is ``engine_api.Engine`` (add, abort, step, stats, load_weights).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictInt, StrictStr, field_validator, model_validator

from rlfleet.common.spec.fields import NonNegInt, PosFloat, PosInt, fail
from rlfleet.common.spec.registry import Kind, KindConfig, Problem, import_failure
from rlfleet.daemons.rollout.sim import timing as sim_timing
from rlfleet.daemons.rollout.sim.lengths import LENGTH_MODELS
from rlfleet.daemons.rollout.sim.timing import DEFAULT_PROFILE, PROFILES, SimTiming

# More concurrent sequences than any engine here batches usefully (vLLM's default
# max_num_seqs is 256): a larger number is a typo such as 1e9, refused before the
# KV-cache check below has to say it in terabytes.
MAX_BATCH_LIMIT = 4096
MAX_LEN_CAP = 4096
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


class TorchEngineConfig(KindConfig):
    kind: Literal["torch"] = "torch"
    max_batch: Annotated[StrictInt, Field(gt=0, le=MAX_BATCH_LIMIT)] = 32  # sequences in flight


class TorchEngineKind(Kind):
    """``engine.TorchEngine``: slot-based continuous batching over an HF causal LM."""

    Config = TorchEngineConfig

    @classmethod
    def build(cls, config: TorchEngineConfig, /, *, model_path: str | Path, dtype: str = "float32",
              device: str = "cpu", **_: Any) -> Any:
        from rlfleet.daemons.rollout.engines.torch_engine import TorchEngine  # torch

        return TorchEngine.from_pretrained(model_path, max_batch=config.max_batch, dtype=dtype,
                                           device=device)

    @classmethod
    def check(cls, config: TorchEngineConfig, sections: Mapping[str, BaseModel]) -> list[Problem]:
        model = sections.get("model")
        if model is None:
            return []
        mc = model.config()  # type: ignore[attr-defined]
        layer_types = set(mc.get("layer_types") or ["full_attention"])
        if layer_types != {"full_attention"}:
            return [(("kind",), f"the torch engine runs full-attention layers only; "
                               f"{model.path} has {sorted(layer_types)}")]  # type: ignore[attr-defined]
        need = kv_cache(mc, config.max_batch, model.dtype)  # type: ignore[attr-defined]
        have = machine_memory_bytes()
        if need is None or have is None or need.bytes <= have:
            return []
        return [(("max_batch",),
                 f"a KV cache of {config.max_batch} slots x {need.max_len} tokens for this model "
                 f"({need.layers} layers, {need.kv_heads} KV heads x {need.head_dim} dims, "
                 f"{model.dtype}) takes {_size(need.bytes)}, more than this machine's memory "  # type: ignore[attr-defined]
                 f"({_size(have)}); the torch engine preallocates it")]


class VllmEngineConfig(KindConfig):
    kind: Literal["vllm"] = "vllm"
    max_batch: Annotated[StrictInt, Field(gt=0, le=MAX_BATCH_LIMIT)] = 32  # vLLM's max_num_seqs
    # vLLM's KV cache (its kv_cache_memory_bytes; VLLM_CPU_KVCACHE_SPACE in GiB is the same
    # knob). None: room for max_batch sequences of the model's length, as the torch engine.
    kv_cache_mib: Annotated[StrictInt, Field(gt=0, le=1 << 20)] | None = None


class VllmEngineKind(Kind):
    """``vllm_engine.VllmEngine``: vLLM's engine in process (vllm-cpu; ``make setup-vllm``)."""

    Config = VllmEngineConfig

    @classmethod
    def build(cls, config: VllmEngineConfig, /, *, model_path: str | Path, dtype: str = "float32",
              **_: Any) -> Any:
        from rlfleet.daemons.rollout.engines.vllm_engine import VllmEngine  # vllm, torch

        return VllmEngine.from_pretrained(model_path, max_batch=config.max_batch, dtype=dtype,
                                          kv_cache_mib=config.kv_cache_mib)

    @classmethod
    def unavailable(cls, config: VllmEngineConfig, /) -> str:
        # Only `rlfleet job validate` asks: rollout hosts run vllm from their own venv
        # (.venv-vllm), which need not be the one that submits or stores the spec.
        return import_failure("vllm")

    @classmethod
    def check(cls, config: VllmEngineConfig, sections: Mapping[str, BaseModel]) -> list[Problem]:
        model = sections.get("model")
        if model is None:
            return []
        from rlfleet.daemons.rollout.engines.vllm_layout import head_problem  # json and numpy only

        problem = head_problem(model.config())  # type: ignore[attr-defined]
        return [(("kind",), f"{model.path}: {problem}")] if problem else []  # type: ignore[attr-defined]


NonNegFloat = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]
LengthsConfig = LENGTH_MODELS.config_type()  # [rollout.engine.lengths], tagged by kind
# A rollout's hardware label (routing's prefer table names these; an etcd record field).
HardwareLabel = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]


class TimingOverrides(BaseModel, extra="forbid", frozen=True):
    """The hardware profile's constants a sim engine table or a pool may override; each
    None: the profile's (sim_timing.PROFILES)."""

    max_batch: Annotated[PosInt, Field(le=MAX_BATCH_LIMIT)] | None = None
    kv_capacity_tokens: PosInt | None = None
    base_s: PosFloat | None = None
    roofline_batch: PosInt | None = None
    kv_s_per_token: NonNegFloat | None = None
    prefill_s_per_token: NonNegFloat | None = None
    load_s: NonNegFloat | None = None


_TIMING_KEYS = tuple(TimingOverrides.model_fields)


class SimPoolConfig(TimingOverrides):
    """``[[rollout.engine.pools]]``: some of the simulated rollouts on another hardware
    profile, with their own label and overrides (absent = the engine table's)."""

    hardware: HardwareLabel
    rollouts: Annotated[PosInt, Field(le=4096)]
    profile: str | None = None

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, name: str | None) -> str | None:
        if name is not None and name not in PROFILES:
            raise fail(f"unknown profile {name!r} (known: {', '.join(map(repr, PROFILES))})")
        return name


class SimEngineConfig(TimingOverrides, KindConfig):
    """``sim_engine.SimEngine``: a timing model instead of a model (docs/design/sim.md)."""

    kind: Literal["sim"] = "sim"
    # Simulated rollouts one rollout process hosts, each its own member (sim_host.py):
    # 64-1,000 fit on 2 cores. Killing the process is a machine failure for all of them.
    rollouts: Annotated[PosInt, Field(le=4096)] = 1
    profile: str = DEFAULT_PROFILE  # a name in sim_timing.PROFILES
    time_scale: PosFloat = 1.0  # wall seconds per model second (0.02 = 50x faster than real)
    # Tokens and lengths are a function of (seed, request): every engine of a fleet must
    # share it, so a turn continued elsewhere goes on with the same tokens.
    seed: Annotated[NonNegInt, Field(le=2**64 - 1)] = 0
    lengths: LengthsConfig = LENGTH_MODELS.field()  # type: ignore[valid-type]
    # Every rollout's hardware label in its etcd record (None: the profile's GPU, "h800").
    hardware: HardwareLabel | None = None
    # A fleet of several hardware kinds: the rollouts are the pools' (rollouts = their sum).
    pools: list[SimPoolConfig] = []

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, name: str) -> str:
        if name not in PROFILES:
            raise fail(f"unknown profile {name!r} (known: {', '.join(map(repr, PROFILES))})")
        return name

    @model_validator(mode="after")
    def _pools_make_the_fleet(self) -> SimEngineConfig:
        if not self.pools:
            return self
        total = sum(p.rollouts for p in self.pools)
        if "rollouts" in self.model_fields_set and self.rollouts != total:
            raise ValueError(f"rollouts: the pools hold {total} rollouts, got rollouts = {self.rollouts} "
                             f"(leave it out with pools)")
        if self.hardware is not None:
            raise ValueError("hardware: each pool names its own; leave it out with pools")
        object.__setattr__(self, "rollouts", total)
        return self

    def label(self) -> str:
        return self.hardware or PROFILES[self.profile].hardware

    def fleet(self) -> list[tuple[str, SimEngineConfig]]:
        """(hardware label, engine config) of every simulated rollout, in member order."""
        if not self.pools:
            return [(self.label(), self)] * self.rollouts
        out = []
        for pool in self.pools:
            update = {k: getattr(pool, k) for k in ("profile", *_TIMING_KEYS) if getattr(pool, k) is not None}
            config = self.model_copy(update={**update, "pools": [], "rollouts": pool.rollouts,
                                             "hardware": pool.hardware})
            out += [(pool.hardware, config)] * pool.rollouts
        return out

    def hardware_labels(self) -> list[str]:
        """The labels this spec's rollouts carry (routing's prefer table is checked against them)."""
        return list(dict.fromkeys(label for label, _ in self.fleet()))

    def cost(self) -> float:
        """The fleet's price in H20-equivalents (RollArt Table 2: H20 1.00, H800 2.85)."""
        return sum(PROFILES[c.profile].cost for _, c in self.fleet())

    def timing(self) -> SimTiming:
        """The profile's constants (model seconds) with this table's overrides."""
        return sim_timing.timing(self.profile, max_batch=self.max_batch,
                                 kv_capacity_tokens=self.kv_capacity_tokens, base_s=self.base_s,
                                 roofline_batch=self.roofline_batch,
                                 kv_s_per_token=self.kv_s_per_token,
                                 prefill_s_per_token=self.prefill_s_per_token, load_s=self.load_s)


class SimEngineKind(Kind):
    """``sim_engine.SimEngine``: serves requests on a timing model (no weights, no torch).

    ``build`` context: ``vocab_size`` and ``eos_token_id`` (default: from the model's
    config.json at ``model_path``), ``clock`` (wall seconds; default time.monotonic)."""

    Config = SimEngineConfig

    @classmethod
    def build(cls, config: SimEngineConfig, /, *, model_path: str | Path | None = None,
              vocab_size: int | None = None, eos_token_id: int | None = None,
              **context: Any) -> Any:
        from rlfleet.daemons.rollout.sim.engine import SimEngine  # numpy

        if vocab_size is None or eos_token_id is None:
            vocab, eos = _vocab_and_eos(model_path)
            vocab_size = vocab if vocab_size is None else vocab_size
            eos_token_id = eos if eos_token_id is None else eos_token_id
        extra = {"clock": context["clock"]} if "clock" in context else {}
        return SimEngine.from_config(config, vocab_size=vocab_size, eos_token_id=eos_token_id,
                                     **extra)

    @classmethod
    def check(cls, config: SimEngineConfig, sections: Mapping[str, BaseModel]) -> list[Problem]:
        model = sections.get("model")
        if model is None:
            return []
        try:
            _vocab_and_eos(model.path)  # type: ignore[attr-defined]
        except ValueError as e:
            return [(("kind",), str(e))]
        return []


def _vocab_and_eos(model_path: str | Path | None) -> tuple[int, int]:
    """The sim engine's vocabulary and EOS id: config.json's vocab_size and (first) eos_token_id."""
    import json

    if model_path is None:
        raise ValueError("the sim engine needs vocab_size and eos_token_id (or a model path)")
    try:
        mc = json.loads((Path(model_path) / "config.json").read_text())
        vocab, eos = mc["vocab_size"], mc["eos_token_id"]
        eos = eos[0] if isinstance(eos, list) else eos
        if not (type(vocab) is int and type(eos) is int and vocab >= 2 and 0 <= eos < vocab):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        raise ValueError(f"the sim engine takes vocab_size (>= 2) and eos_token_id (< vocab_size) "
                         f"from {model_path}/config.json, which lacks them") from None
    return vocab, eos


@dataclasses.dataclass(frozen=True)
class KVCache:
    """A preallocated KV cache's size and the figures it was computed from."""

    bytes: int
    layers: int
    kv_heads: int
    head_dim: int
    max_len: int


def kv_cache(model_config: dict[str, Any], max_batch: int, dtype: str) -> KVCache | None:
    """What TorchEngine allocates (engine.py: per layer K and V of [max_batch, kv_heads,
    max_len, head_dim]), or None when config.json lacks the figures."""
    try:
        heads = int(model_config["num_attention_heads"])
        layers = int(model_config["num_hidden_layers"])
        head_dim = int(model_config.get("head_dim") or int(model_config["hidden_size"]) // heads)
        kv_heads = int(model_config.get("num_key_value_heads") or heads)
        max_len = default_max_len(model_config)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    size = 2 * layers * max_batch * kv_heads * max_len * head_dim * _DTYPE_BYTES[dtype]
    return KVCache(size, layers, kv_heads, head_dim, max_len)


def default_max_len(model_config: Any) -> int:
    """Tokens per KV slot: the model's context, capped (a slot is preallocated whole)."""
    get = model_config.get if isinstance(model_config, dict) else (
        lambda key, default: getattr(model_config, key, default))
    return min(int(get("max_position_embeddings", 2048)), MAX_LEN_CAP)


def machine_memory_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001 — no figure, no check
        return None


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError
