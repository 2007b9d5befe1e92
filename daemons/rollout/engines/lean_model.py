"""A Qwen2/Llama checkpoint loaded without transformers, for ``forward.LeanForward``.

Why: the rollout runs such models through LeanForward anyway, and importing
transformers' model code (which pulls in torch._dynamo) costs ~2.3 CPU-s per rollout
start, a tenth of the rollout's CPU in a 1000-step run. ``load`` reads config.json and
the safetensors file into a module tree with transformers' parameter names (so a
state dict from the trainer loads unchanged), and returns None for anything it does
not recognise exactly; the engine then loads the model through transformers.

That the arithmetic equals transformers' is a test (tests/daemons/rollout/test_engine.py
compares both on a random Qwen2), not a start-up probe: there is no transformers model
here to compare with.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

log = logging.getLogger("rlfleet.rollout")

_TYPES = {"qwen2": True, "llama": False}  # model_type -> q/k/v projections have biases


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.variance_epsilon = eps


class _Rotary:
    """cos, sin of the default rope, computed as transformers computes them."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class _Weights(nn.Module):
    """A linear layer's (or the embedding's) parameters, uninitialised: nn.Linear's random
    init is wasted work here, and init on the meta device imports torch._dynamo (~2 CPU-s)."""

    def __init__(self, n_in: int, n_out: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))
        self.bias = nn.Parameter(torch.empty(n_out)) if bias else None


_linear = _Weights


class LeanModel(nn.Module):
    """Parameters only (no forward): model.embed_tokens, model.layers.N.{input_layernorm,
    self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj},
    model.norm, lm_head (tied to the embedding when the config says so)."""

    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        c = config
        hd = c.head_dim
        self.model = nn.Module()
        self.model.embed_tokens = _Weights(c.hidden_size, c.vocab_size)
        self.model.layers = nn.ModuleList()
        for _ in range(c.num_hidden_layers):
            layer = nn.Module()
            attn = layer.self_attn = nn.Module()
            attn.q_proj = _linear(c.hidden_size, c.num_attention_heads * hd, c.qkv_bias)
            attn.k_proj = _linear(c.hidden_size, c.num_key_value_heads * hd, c.qkv_bias)
            attn.v_proj = _linear(c.hidden_size, c.num_key_value_heads * hd, c.qkv_bias)
            attn.o_proj = _linear(c.num_attention_heads * hd, c.hidden_size, False)
            attn.head_dim, attn.scaling = hd, hd ** -0.5
            mlp = layer.mlp = nn.Module()
            mlp.gate_proj = _linear(c.hidden_size, c.intermediate_size, False)
            mlp.up_proj = _linear(c.hidden_size, c.intermediate_size, False)
            mlp.down_proj = _linear(c.intermediate_size, c.hidden_size, False)
            layer.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
            layer.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.model.layers.append(layer)
        self.model.norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.model.rotary_emb = _Rotary(hd, c.rope_theta)
        self.lm_head = _linear(c.hidden_size, c.vocab_size, False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.generation_config = SimpleNamespace(eos_token_id=c.generation_eos)

    @property
    def base_model(self) -> nn.Module:
        return self.model

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def load(path: str | Path, dtype: torch.dtype, device: str = "cpu") -> LeanModel | None:
    """The checkpoint as a LeanModel, or None (reason logged) if it is not a plain
    Qwen2/Llama checkpoint this module reproduces exactly."""
    path = Path(path)
    try:
        raw = json.loads((path / "config.json").read_text())
        why = _unsupported(raw, path)
        if why:
            log.info("model loaded through transformers: %s", why)
            return None
        config = _config(raw, path)
        from safetensors.torch import load_file  # torch only, no transformers

        tensors = load_file(str(path / "model.safetensors"), device=device)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.info("model loaded through transformers: %s", exc)
        return None
    model = LeanModel(config)
    expected = dict(model.state_dict())
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    if set(tensors) != set(expected) or any(tensors[k].shape != v.shape for k, v in expected.items()):
        log.info("model loaded through transformers: %s holds other tensors than a %s of this config",
                 path, config.model_type)
        return None
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.data = tensors[name].to(dtype=dtype, device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def _unsupported(raw: dict[str, Any], path: Path) -> str | None:
    kind = raw.get("model_type")
    if kind not in _TYPES:
        return f"model type {kind!r}"
    if not (path / "model.safetensors").is_file():
        return "no single model.safetensors"
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"rope {rope}"
    if raw.get("hidden_act", "silu") != "silu":
        return f"activation {raw.get('hidden_act')!r}"
    layer_types = set(raw.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"} or raw.get("use_sliding_window"):
        return "sliding-window layers"
    if kind == "llama" and (raw.get("attention_bias") or raw.get("mlp_bias")):
        return "llama with biases"
    if raw.get("attention_dropout", 0.0):
        return "attention dropout"
    if raw.get("head_dim") not in (None, raw["hidden_size"] // raw["num_attention_heads"]):
        return "a head_dim other than hidden_size / heads"
    return None


def _config(raw: dict[str, Any], path: Path) -> SimpleNamespace:
    heads = int(raw["num_attention_heads"])
    rope = raw.get("rope_parameters") or {}
    generation = {}
    if (path / "generation_config.json").is_file():
        generation = json.loads((path / "generation_config.json").read_text())
    return SimpleNamespace(
        model_type=raw["model_type"], vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]), num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads, num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw["hidden_size"]) // heads, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_parameters={"rope_type": "default"}, hidden_act="silu",
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=_TYPES[raw["model_type"]], layer_types=["full_attention"] * int(raw["num_hidden_layers"]),
        eos_token_id=raw.get("eos_token_id"), generation_eos=generation.get("eos_token_id"),
        _attn_implementation="sdpa")
