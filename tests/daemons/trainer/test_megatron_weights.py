"""The megatron backend's CPU-only parts that need no megatron-core: the HF config it
accepts, the HF <-> megatron weight mapping (layouts and bit-exact round trips) and the
spec's [trainer.backend] kind = "megatron" (its refusals, and validation staying light)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rlfleet.common.spec.errors import SpecError
from rlfleet.common.spec.job import parse_spec
from rlfleet.daemons.trainer.megatron import weights as mw

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "models" / "tiny-qwen2"


def tiny_config() -> dict:
    return json.loads((TINY / "config.json").read_text())


def random_hf(shape: mw.ModelShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under every HF name, shaped as an HF Qwen2 of ``shape`` has them."""
    g = torch.Generator().manual_seed(seed)
    h, d, f = shape.hidden, shape.head_dim, shape.ffn
    sizes = {"q_proj.weight": (shape.heads * d, h), "q_proj.bias": (shape.heads * d,),
             "k_proj.weight": (shape.groups * d, h), "k_proj.bias": (shape.groups * d,),
             "v_proj.weight": (shape.groups * d, h), "v_proj.bias": (shape.groups * d,),
             "o_proj.weight": (h, shape.heads * d), "gate_proj.weight": (f, h),
             "up_proj.weight": (f, h), "down_proj.weight": (h, f), "layernorm.weight": (h,)}
    out = {}
    for name in mw.hf_names(shape):
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            size = (shape.vocab, h)
        elif name == "model.norm.weight":
            size = (h,)
        else:
            size = next(s for suffix, s in sizes.items() if name.endswith(suffix))
        out[name] = torch.randn(size, generator=g)
    if shape.tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def test_the_shipped_model_maps_to_its_shape():
    shape = mw.shape_from_hf(tiny_config())
    assert shape == mw.ModelShape(layers=3, hidden=96, heads=4, groups=2, head_dim=24, ffn=384,
                                  vocab=36, tied=True, rope_theta=10000.0, rms_eps=1e-6,
                                  max_positions=256)
    assert shape.q_per_group == 2
    # transformers 4.x kept rope_theta at the top level
    old = {**tiny_config(), "rope_theta": 5e5}
    del old["rope_parameters"]
    assert mw.shape_from_hf(old).rope_theta == 5e5


@pytest.mark.parametrize("change, says", [
    ({"model_type": "llama"}, "model_type 'llama': the megatron backend maps qwen2 only"),
    ({"num_key_value_heads": 3}, "num_attention_heads (4) is not a multiple of num_key_value_heads (3)"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu': only silu (SwiGLU) maps"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type 'yarn'"),
    ({"hidden_size": "wide"}, "config.json: ValueError"),
])
def test_configs_that_cannot_map_are_refused_by_name(change, says):
    with pytest.raises(mw.UnsupportedModel) as info:
        mw.shape_from_hf({**tiny_config(), **change})
    assert says in str(info.value)


def test_fused_qkv_is_grouped_per_key_value_head():
    """Megatron reads linear_qkv as [groups, q heads of the group + k + v]: group g's rows
    are its q heads, then k head g, then v head g. Rows are labelled by origin to check."""
    shape = mw.ModelShape(layers=1, hidden=4, heads=6, groups=2, head_dim=2, ffn=8, vocab=5,
                          tied=True, rope_theta=1e4, rms_eps=1e-6, max_positions=16)
    q = torch.arange(12.0)[:, None] + 100  # q head i = rows 2i, 2i+1
    k = torch.arange(4.0)[:, None] + 200
    v = torch.arange(4.0)[:, None] + 300
    fused = mw.fuse_qkv(q, k, v, shape)[:, 0].tolist()
    assert fused == [100, 101, 102, 103, 104, 105, 200, 201, 300, 301,  # group 0: q0 q1 q2 k0 v0
                     106, 107, 108, 109, 110, 111, 202, 203, 302, 303]  # group 1: q3 q4 q5 k1 v1
    back = mw.split_qkv(mw.fuse_qkv(q, k, v, shape), shape)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))
    with pytest.raises(ValueError, match="linear_qkv has 19 rows, the shape needs 20"):
        mw.split_qkv(torch.zeros(19, 1), shape)


@pytest.mark.parametrize("groups, tied", [(2, True), (1, False), (4, True)])
def test_hf_to_megatron_to_hf_is_bit_exact(groups, tied):
    shape = mw.ModelShape(layers=2, hidden=16, heads=4, groups=groups, head_dim=4, ffn=24, vocab=11,
                          tied=tied, rope_theta=1e4, rms_eps=1e-6, max_positions=32)
    hf = random_hf(shape)
    mc = mw.hf_to_mcore(hf, shape)
    assert sorted(mc) == sorted(mw.mcore_names(shape))
    assert ("output_layer.weight" in mc) is not tied
    fc1 = mc["decoder.layers.1.mlp.linear_fc1.weight"]  # [gate | up]: silu on the first half
    assert torch.equal(fc1[:24], hf["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(fc1[24:], hf["model.layers.1.mlp.up_proj.weight"])
    back = mw.mcore_to_hf(mc, shape)
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    if tied:  # as HF's state_dict: the head is the embedding tensor itself
        assert back["lm_head.weight"] is back["model.embed_tokens.weight"]
    again = mw.hf_to_mcore(back, shape)
    assert all(torch.equal(again[n], mc[n]) for n in mc)


def test_the_shipped_weights_round_trip_under_the_hf_models_own_names():
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    shape = mw.shape_from_hf(tiny_config())
    stored = load_file(str(TINY / "model.safetensors"))  # tied: the file has no lm_head
    assert "lm_head.weight" not in stored
    back = mw.mcore_to_hf(mw.hf_to_mcore(stored, shape), shape)
    model_names = set(AutoModelForCausalLM.from_pretrained(str(TINY)).state_dict())
    assert set(back) == model_names == set(mw.hf_names(shape))
    assert all(torch.equal(back[n], stored[n]) for n in stored)


def test_mapping_refuses_missing_weights_and_an_untied_head_on_a_tied_model():
    shape = mw.shape_from_hf(tiny_config())
    hf = random_hf(shape)
    hf["lm_head.weight"] = hf["lm_head.weight"] + 1
    with pytest.raises(mw.UnsupportedModel, match="lm_head.weight differs"):
        mw.hf_to_mcore(hf, shape)
    del hf["model.layers.2.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="HF weights lack model.layers.2.mlp.up_proj.weight"):
        mw.hf_to_mcore(hf, shape)
    with pytest.raises(KeyError, match="megatron weights lack embedding.word_embeddings.weight"):
        mw.mcore_to_hf({}, shape)


def megatron_spec(**backend) -> dict:
    return {"job": {"name": "m"}, "model": {"path": str(TINY)}, "task": {"env": {"kind": "arithmetic"}},
            "trainer": {"backend": {"kind": "megatron", **backend}}}


def test_the_spec_refuses_what_the_layout_cannot_take_with_the_reason():
    assert parse_spec(megatron_spec()).trainer.backend.tensor_parallel == 1
    with pytest.raises(SpecError) as info:
        parse_spec(megatron_spec(tensor_parallel=2, data_parallel=2))
    assert ("trainer.backend.tensor_parallel: TP 2 x PP 1 x DP 2 = 4 ranks: the trainer daemon runs one "
            "rank until it forms a trainer group") in str(info.value)
    # tiny-qwen2 has 2 key/value heads, 4 heads and a vocabulary of 36: TP 4 splits no group
    with pytest.raises(SpecError, match=r"trainer.backend.tensor_parallel: 4 does not divide the model's "
                                        r"num_key_value_heads \(2\)"):
        parse_spec(megatron_spec(tensor_parallel=4))
    with pytest.raises(SpecError, match="trainer.backend.pipeline_parallel: 4: pipeline parallelism is not built"):
        parse_spec(megatron_spec(pipeline_parallel=4))
    with pytest.raises(SpecError, match="trainer.backend.tensor_parallel: must be > 0, got 0"):
        parse_spec(megatron_spec(tensor_parallel=0))
    with pytest.raises(SpecError, match="trainer.backend.data_parallel: must be > 0, got 0"):
        parse_spec(megatron_spec(data_parallel=0))


def test_the_spec_refuses_a_model_the_backend_cannot_map(tmp_path):
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**tiny_config(), "model_type": "llama"}))
    (model / "model.safetensors").write_bytes((TINY / "model.safetensors").read_bytes())
    spec = megatron_spec()
    spec["model"]["path"] = str(model)
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    assert f"trainer.backend: model.path {model}: model_type 'llama'" in str(info.value)


def test_validating_a_megatron_spec_imports_neither_torch_nor_megatron(tmp_path):
    spec = tmp_path / "m.toml"
    spec.write_text(f"""[job]\nname = "m"\n[model]\npath = {str(TINY)!r}\n"""
                    """[task.env]\nkind = "arithmetic"\n[trainer.backend]\nkind = "megatron"\n""")
    code = textwrap.dedent(f"""
        import sys
        from rlfleet.common.spec.job import load_spec
        assert load_spec({str(spec)!r}).trainer.backend.kind == "megatron"
        print(",".join(sorted(m for m in ("torch", "megatron", "transformers", "numpy")
                              if m in sys.modules)))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_tensor_parallel_slices_put_together_again():
    shape = mw.shape_from_hf(tiny_config())
    hf = random_hf(shape)
    halves = [mw.hf_slice(hf, 2, r) for r in (0, 1)]
    # whole heads and groups per rank: q has 2 of 4 heads, k and v 1 of 2 groups
    assert halves[1]["model.layers.0.self_attn.q_proj.weight"].shape == (2 * shape.head_dim, shape.hidden)
    assert halves[1]["model.layers.0.self_attn.k_proj.weight"].shape == (shape.head_dim, shape.hidden)
    assert halves[0]["model.layers.0.self_attn.o_proj.weight"].shape == (shape.hidden, shape.hidden // 2)
    assert halves[0]["model.embed_tokens.weight"].shape == (shape.vocab // 2, shape.hidden)
    assert halves[0]["model.norm.weight"] is hf["model.norm.weight"]
    # each half maps to megatron names at the local shape and back
    local = mw.local_shape(shape, 2)
    back = [mw.mcore_to_hf(mw.hf_to_mcore(h, local), local) for h in halves]
    joined = mw.hf_join(back)
    assert set(joined) == set(hf) and all(joined[n].equal(hf[n]) for n in hf)
    as_numpy = mw.hf_join([{n: t.numpy() for n, t in h.items()} for h in halves])
    assert all((as_numpy[n] == hf[n].numpy()).all() for n in hf)


def test_the_layout_says_what_the_model_cannot_split():
    from rlfleet.daemons.trainer.megatron.layout import Layout

    shape = mw.shape_from_hf(tiny_config())
    assert Layout(2, 1, 2).problems(shape) == [] and Layout(2, 1, 2).world == 4
    assert Layout(4).problems(shape) == [("tensor_parallel", "4 does not divide the model's num_key_value_heads (2)")]
    assert [k for k, _ in Layout(3).problems(shape)] == ["tensor_parallel"] * 2  # heads, groups
    assert Layout(pipeline=2).problems()[0][0] == "pipeline_parallel"
