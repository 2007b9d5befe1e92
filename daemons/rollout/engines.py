"""The rollout-engine seam: the spec table ``[rollout.engine]`` of each engine kind.

Registered in pyproject.toml (``rlfleet.rollout_engines``). This module is imported
whenever a spec is validated, so it holds configs only; ``build`` imports torch.
The engine interface itself is ``engine.Engine`` (add, abort, step, stats, load_weights).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictInt

from rlfleet.common.registry import Kind, KindConfig, Problem

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
        from .engine import TorchEngine  # torch

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
