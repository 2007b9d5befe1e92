"""HF Qwen2 <-> megatron-core GPTModel: the model's shape and its weight names, both ways.

Pure functions over tensors (torch only, no megatron import), so the mapping is tested on
any machine. torch is imported by the functions that build tensors: backends.py's check()
reads a config through ``shape_from_hf`` while a spec validates, without torch.

The megatron names are those of ``GPTModel`` built with the *local* layer spec
(``get_gpt_layer_local_spec``: separate norms, no TransformerEngine fusion), one
tensor-parallel rank:

    HF (Qwen2ForCausalLM)                                 megatron-core (GPTModel)
    model.embed_tokens.weight                              embedding.word_embeddings.weight
    model.layers.i.input_layernorm.weight                  decoder.layers.i.input_layernorm.weight
    model.layers.i.self_attn.{q,k,v}_proj.{weight,bias}    decoder.layers.i.self_attention.linear_qkv.{weight,bias}
    model.layers.i.self_attn.o_proj.weight                 decoder.layers.i.self_attention.linear_proj.weight
    model.layers.i.post_attention_layernorm.weight         decoder.layers.i.pre_mlp_layernorm.weight
    model.layers.i.mlp.{gate,up}_proj.weight               decoder.layers.i.mlp.linear_fc1.weight
    model.layers.i.mlp.down_proj.weight                    decoder.layers.i.mlp.linear_fc2.weight
    model.norm.weight                                      decoder.final_layernorm.weight
    lm_head.weight                                         output_layer.weight (absent when tied)

Fused layouts:
- ``linear_qkv`` is grouped per key/value head (megatron's SelfAttention splits its
  output as [groups, (heads/groups + 2) x head_dim] and takes q, k, v from each group):
  rows = for g in groups: [q heads of group g | k head g | v head g]. Plain
  concatenation [q | k | v] would load without complaint and compute garbage.
- ``linear_fc1`` is [gate | up]: megatron's gated MLP applies the activation to the
  first half and multiplies by the second (SwiGLU with silu).

With tied embeddings the HF names carry ``lm_head.weight`` as the same tensor as
``model.embed_tokens.weight`` (what ``state_dict()`` of the HF model gives), and the
megatron model has no ``output_layer.weight`` (it shares the embedding).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SUPPORTED_MODEL_TYPES = ("qwen2",)


class UnsupportedModel(ValueError):
    """An HF config this mapping cannot express (the message names the key)."""


@dataclass(frozen=True)
class ModelShape:
    """What the mapping needs of an HF Qwen2 config.json."""

    layers: int
    hidden: int
    heads: int
    groups: int  # key/value heads
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    rope_theta: float
    rms_eps: float
    max_positions: int

    @property
    def q_per_group(self) -> int:
        return self.heads // self.groups


def shape_from_hf(config: Mapping[str, Any]) -> ModelShape:
    """The shape of an HF config.json (a dict); UnsupportedModel for what cannot map."""
    kind = config.get("model_type")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(f"model_type {kind!r}: the megatron backend maps "
                               f"{', '.join(SUPPORTED_MODEL_TYPES)} only")
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        groups = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        shape = ModelShape(
            layers=int(config["num_hidden_layers"]), hidden=hidden, heads=heads, groups=groups,
            head_dim=head_dim, ffn=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]), tied=bool(config.get("tie_word_embeddings", False)),
            rope_theta=_rope_theta(config), rms_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_positions=int(config.get("max_position_embeddings", 32768)))
    except (KeyError, TypeError, ValueError) as exc:
        raise UnsupportedModel(f"config.json: {type(exc).__name__}: {exc}") from exc
    if heads % groups:
        raise UnsupportedModel(f"num_attention_heads ({heads}) is not a multiple of "
                               f"num_key_value_heads ({groups})")
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {config.get('hidden_act')!r}: only silu (SwiGLU) maps")
    if config.get("use_sliding_window"):
        raise UnsupportedModel("use_sliding_window: sliding-window attention does not map "
                               "to the local layer spec")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else None
    if rope_type not in ("default", None):
        raise UnsupportedModel(f"rope_type {rope_type!r}: only plain RoPE maps")
    return shape


def _rope_theta(config: Mapping[str, Any]) -> float:
    # transformers 5 keeps it in rope_parameters, 4.x at the top level.
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(config.get("rope_theta", 10000.0))


# -- names ------------------------------------------------------------------------------
_LAYER_SIMPLE = (  # (HF suffix, megatron suffix), one tensor each
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
    ("mlp.down_proj.weight", "mlp.linear_fc2.weight"),
)
_TOP_SIMPLE = (
    ("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
    ("model.norm.weight", "decoder.final_layernorm.weight"),
)


def hf_names(shape: ModelShape) -> list[str]:
    """Every HF name of the model's state_dict (lm_head.weight too when tied)."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        names += [p + hf for hf, _ in _LAYER_SIMPLE]
        names += [f"{p}self_attn.{x}_proj.{w}" for x in "qkv" for w in ("weight", "bias")]
        names += [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
    return names


def mcore_names(shape: ModelShape) -> list[str]:
    """Every megatron parameter name (no ``_extra_state``)."""
    names = [mc for _, mc in _TOP_SIMPLE] + ([] if shape.tied else ["output_layer.weight"])
    for i in range(shape.layers):
        p = f"decoder.layers.{i}."
        names += [p + mc for _, mc in _LAYER_SIMPLE]
        names += [p + "self_attention.linear_qkv.weight", p + "self_attention.linear_qkv.bias",
                  p + "mlp.linear_fc1.weight"]
    return names


# -- fused tensors ------------------------------------------------------------------------
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """[heads*d | groups*d | groups*d] (rows, any trailing dims) -> megatron's grouped rows."""
    import torch

    d, g, n = shape.head_dim, shape.groups, shape.q_per_group
    rest = q.shape[1:]
    qg = q.reshape(g, n * d, *rest)
    kg = k.reshape(g, d, *rest)
    vg = v.reshape(g, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(g * (n + 2) * d, *rest)


def split_qkv(qkv: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of fuse_qkv."""
    d, g, n = shape.head_dim, shape.groups, shape.q_per_group
    rest = qkv.shape[1:]
    if qkv.shape[0] != g * (n + 2) * d:
        raise ValueError(f"linear_qkv has {qkv.shape[0]} rows, the shape needs {g * (n + 2) * d}")
    grouped = qkv.reshape(g, (n + 2) * d, *rest)
    q, k, v = grouped.split([n * d, d, d], dim=1)
    return (q.reshape(g * n * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest))


# -- whole state dicts ------------------------------------------------------------------
def hf_to_mcore(hf: Mapping[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """HF-named tensors -> megatron-named tensors (new tensors for the fused ones).

    With tied embeddings ``lm_head.weight`` may be absent (an HF safetensors file omits
    it) or present; present, it must equal the embedding, else the model is not tied."""
    import torch

    _require(hf, [n for n in hf_names(shape) if n != "lm_head.weight" or not shape.tied], "HF")
    out = {mc: hf[name] for name, mc in _TOP_SIMPLE}
    if shape.tied:
        head = hf.get("lm_head.weight")
        if head is not None and not head.equal(hf["model.embed_tokens.weight"]):
            raise UnsupportedModel("tie_word_embeddings is true but lm_head.weight differs "
                                   "from model.embed_tokens.weight")
    else:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(shape.layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_suffix, mc_suffix in _LAYER_SIMPLE:
            out[m + mc_suffix] = hf[h + hf_suffix]
        for w in ("weight", "bias"):
            out[f"{m}self_attention.linear_qkv.{w}"] = fuse_qkv(
                *(hf[f"{h}self_attn.{x}_proj.{w}"] for x in "qkv"), shape)
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]], dim=0)
    return out


def mcore_to_hf(mc: Mapping[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Megatron-named tensors -> the HF model's state_dict names (views where possible).

    Tied: ``lm_head.weight`` is the embedding tensor itself, as in HF's state_dict."""
    _require(mc, mcore_names(shape), "megatron")
    out = {name: mc[m] for name, m in _TOP_SIMPLE}
    out["lm_head.weight"] = mc["embedding.word_embeddings.weight" if shape.tied else "output_layer.weight"]
    for i in range(shape.layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_suffix, mc_suffix in _LAYER_SIMPLE:
            out[h + hf_suffix] = mc[m + mc_suffix]
        for w in ("weight", "bias"):
            q, k, v = split_qkv(mc[f"{m}self_attention.linear_qkv.{w}"], shape)
            out[f"{h}self_attn.q_proj.{w}"], out[f"{h}self_attn.k_proj.{w}"] = q, k
            out[f"{h}self_attn.v_proj.{w}"] = v
        gate, up = mc[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
    return out


def _require(tensors: Mapping[str, Any], names: list[str], side: str) -> None:
    missing = [n for n in names if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise KeyError(f"{side} weights lack {', '.join(missing[:3])}{more}")


# -- tensor-parallel slices ---------------------------------------------------------------
# A tensor-parallel rank holds a contiguous slice of every split HF tensor: whole heads
# (q rows of its heads, k/v rows of its key/value groups: contiguous, because a rank holds
# whole groups and a group's heads are consecutive), its rows of gate and up (megatron
# splits each half of fc1 apart, so fc1 local = [gate slice | up slice]), its vocabulary
# rows of the embedding and head (VocabParallelEmbedding), and its input columns of
# o_proj and down_proj (RowParallelLinear). The norms are whole on every rank.
_ROW_SPLIT = ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
              "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias",
              "mlp.gate_proj.weight", "mlp.up_proj.weight")
_COLUMN_SPLIT = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def split_dim(hf_name: str) -> int | None:
    """The dimension along which tensor parallelism splits an HF tensor; None: whole on every rank."""
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight") or hf_name.endswith(_ROW_SPLIT):
        return 0
    if hf_name.endswith(_COLUMN_SPLIT):
        return 1
    return None


def local_shape(shape: ModelShape, tensor_parallel: int) -> ModelShape:
    """The shape one tensor-parallel rank's tensors have (the layout checked it divides)."""
    from dataclasses import replace

    tp = tensor_parallel
    return replace(shape, heads=shape.heads // tp, groups=shape.groups // tp, ffn=shape.ffn // tp,
                   vocab=shape.vocab // tp)


def hf_slice(hf: Mapping[str, torch.Tensor], tensor_parallel: int, rank: int) -> dict[str, torch.Tensor]:
    """A tensor-parallel rank's slice of whole HF tensors (views)."""
    out = {}
    for name, t in hf.items():
        dim = split_dim(name)
        out[name] = t if dim is None or tensor_parallel == 1 else t.chunk(tensor_parallel, dim=dim)[rank]
    return out


def hf_join(slices: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Whole HF tensors (torch or numpy) from every tensor-parallel rank's slice, in rank
    order (the inverse of hf_slice; a tensor whole on every rank is taken from rank 0)."""
    out = {}
    for name, first in slices[0].items():
        dim = split_dim(name)
        if dim is None or len(slices) == 1:
            out[name] = first
            continue
        parts = [s[name] for s in slices]
        if hasattr(first, "numpy"):  # a torch tensor
            import torch

            out[name] = torch.cat(parts, dim=dim)
        else:
            import numpy as np

            out[name] = np.concatenate(parts, axis=dim)
    return out
