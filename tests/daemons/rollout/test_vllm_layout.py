"""vllm_layout's padded heads compute exactly what the model computes (no vLLM needed:
transformers' Qwen2 takes head_dim from its config, so the padded weights run in it too),
and the refusals name why a model cannot be padded."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rlfleet.daemons.rollout.engines.vllm_layout import CPU_HEAD_SIZES, checkpoint_shapes, head_problem, prepare
from tests.integration.helpers import TINY_MODEL


def padded_twin(model_dir, tmp_path):
    """The checkpoint as vLLM is given it, loaded into transformers as a Qwen2."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    layout = prepare(model_dir, tmp_path / "served")
    served = json.loads((layout.model_dir / "config.json").read_text())
    config = json.loads((model_dir / "config.json").read_text())
    config.update(head_dim=served["head_dim"], rope_parameters=served["rope_parameters"])
    twin = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in config.items() if k != "architectures"}))
    from safetensors.numpy import load_file

    tensors = load_file(str(layout.model_dir / "model.safetensors"))
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=False)
    return layout, twin.eval(), served


@pytest.mark.parametrize("which", ["shipped", "random"])
def test_padded_heads_give_the_same_logits(which, tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model_dir = TINY_MODEL if which == "shipped" else tiny_model_dir  # heads of 24 and of 16
    layout, twin, served = padded_twin(model_dir, tmp_path)
    assert layout.padded and layout.padded_dim == 32 and layout.head_dim in (16, 24)
    assert served["architectures"] == ["LlamaForCausalLM"] and served["qkv_bias"] is True
    assert served["attention_bias"] is False  # Qwen2: biases on q/k/v, none on o_proj
    original = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([[(7 * i + 3) % original.config.vocab_size for i in range(60)]])
    with torch.inference_mode():
        want, got = original(ids).logits, twin(ids).logits
    assert torch.allclose(want, got, atol=2e-5, rtol=1e-4), float((want - got).abs().max())


def test_a_supported_head_size_is_served_as_it_is(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=40, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)  # heads of 32
    Qwen2ForCausalLM(config).save_pretrained(str(tmp_path / "m"))
    layout = prepare(tmp_path / "m", tmp_path / "served")
    assert layout.model_dir == tmp_path / "m" and not layout.padded
    assert not (tmp_path / "served").exists()
    assert dict(layout.convert({"x": np.ones(3)}))["x"].tolist() == [1, 1, 1]


def test_checkpoint_shapes_read_the_header_only():
    shapes = checkpoint_shapes(TINY_MODEL)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == ((96, 96), "F32")
    assert shapes["model.embed_tokens.weight"] == ((36, 96), "F32") and "lm_head.weight" not in shapes


def test_models_that_cannot_be_padded_are_refused_with_the_reason():
    base = {"num_attention_heads": 4, "hidden_size": 96, "model_type": "qwen2",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert head_problem(base) is None  # 24: padded to 32
    assert head_problem({**base, "hidden_size": 128}) is None  # 32: served as it is
    assert head_problem({**base, "model_type": "gemma"}) == (
        f"vLLM's CPU attention runs head sizes {list(CPU_HEAD_SIZES)}, the model has 24, and padding "
        "heads is implemented for ['llama', 'qwen2'], not 'gemma'")
    assert "needs the default RoPE" in head_problem({**base, "rope_parameters": {"rope_type": "yarn",
                                                                                   "rope_theta": 1e4}})
    assert "partial_rotary_factor" in head_problem({**base, "partial_rotary_factor": 0.5})
    assert "no supported head size to pad 1000 to" in head_problem({**base, "hidden_size": 4000})
    assert head_problem({}) is None  # no figures: vLLM says at start-up what it lacks
