"""Random models of real shapes (tools/model_shapes.py), checked on shrunk variants.

A full qwen2-100m takes longer than a test may on the 2-core CI machine, so these build
qwen2-100m with 2 layers and a 512-token vocabulary through the same code path; the
counts of the full shapes are checked against count_params, which the shrunk builds check
against the models themselves.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from rlfleet.tools import model_shapes  # noqa: E402
from rlfleet.tools.model_shapes import SHAPES, count_params, shape_fields, synthetic_bpe, write_shape  # noqa: E402

SHRUNK = {"num_hidden_layers": 2, "vocab_size": 512}
TEXT = "Hello world, the quick brown fox jumps over 12 lazy dogs.\nnaïve café 😀\tend"


def build(tmp_path_factory, name: str, **kwargs) -> Path:
    out = tmp_path_factory.mktemp(name)
    write_shape("qwen2-100m", out, **{**SHRUNK, **kwargs})
    return out


@pytest.fixture(scope="module")
def small_f32(tmp_path_factory) -> Path:
    return build(tmp_path_factory, "f32", dtype="float32", seed=0)


def tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_the_docstring_states_each_shapes_parameter_count():
    for name, fields in SHAPES.items():
        assert f"``{name}``: {count_params(fields):,} parameters" in model_shapes.__doc__
    # Qwen2-0.5B as published: its architecture and its 0.49B parameters.
    real = shape_fields("qwen2-0.5b")
    assert {k: real[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                 "intermediate_size", "vocab_size", "tie_word_embeddings")} == {
        "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}
    assert round(count_params(real) / 1e6) == 494


def test_a_bad_shape_or_override_is_a_clear_error(capsys):
    with pytest.raises(ValueError, match="unknown model shape 'qwen2-7b'; known shapes: qwen2-0.5b, qwen2-100m"):
        shape_fields("qwen2-7b")
    with pytest.raises(ValueError, match="cannot override \\['layers'\\]"):
        shape_fields("qwen2-100m", layers=2)
    with pytest.raises(SystemExit):
        model_shapes.main(["--shape", "qwen2-7b", "--out", "/nonexistent"])
    assert "qwen2-0.5b" in capsys.readouterr().err


def test_the_synthetic_tokenizer_fills_the_vocabulary_exactly():
    for size in (259, 300, 2000):
        vocab, merges = synthetic_bpe(size)
        assert sorted(vocab.values()) == list(range(size))
        assert all(a + b in vocab for a, b in merges)  # every merge makes a token of the vocabulary
    with pytest.raises(ValueError, match=">= 259"):
        synthetic_bpe(258)


def test_the_folder_holds_the_tables_config_and_its_parameter_count(small_f32):
    from transformers import AutoConfig

    fields = shape_fields("qwen2-100m", **SHRUNK)
    config = AutoConfig.from_pretrained(str(small_f32)).to_dict()
    assert {k: config[k] for k in fields} == fields
    assert config["model_type"] == "qwen2" and config["dtype"] == "float32"
    record = json.loads((small_f32 / model_shapes.SHAPE_FILE).read_text())
    assert record == {**record, "shape": "qwen2-100m", "params": count_params(fields), "seed": 0,
                      "dtype": "float32", "overrides": SHRUNK, "random_weights": True}
    state = tensors(small_f32)
    assert "lm_head.weight" not in state  # tied: saved once
    assert sum(t.numel() for t in state.values()) == count_params(fields)
    assert {t.dtype for t in state.values()} == {torch.float32}


def test_transformers_loads_it_and_the_tokenizer_round_trips(small_f32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(small_f32))
    assert len(tokenizer) == SHRUNK["vocab_size"] == tokenizer.eos_token_id + 3
    assert tokenizer.decode(tokenizer(TEXT)["input_ids"]) == TEXT
    assert tokenizer("<|im_start|>user<|im_end|>")["input_ids"][0] == tokenizer.eos_token_id + 1
    model = AutoModelForCausalLM.from_pretrained(str(small_f32), dtype=torch.float32).eval()
    batch = tokenizer([TEXT, "the end"], return_tensors="pt", padding=True)
    with torch.inference_mode():
        logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], SHRUNK["vocab_size"])
    assert torch.isfinite(logits).all()


def test_the_torch_engine_loads_it_and_generates(small_f32):
    from transformers import AutoTokenizer

    from rlfleet.common.wire.arrays import Int32Array
    from rlfleet.common.wire.messages import GenerateRequest
    from rlfleet.daemons.rollout.engines.lean_model import LeanModel
    from rlfleet.daemons.rollout.engines.torch_engine import TorchEngine

    engine = TorchEngine.from_pretrained(small_f32, max_batch=2, max_len=64, seed=0)
    assert isinstance(engine.model, LeanModel)  # one safetensors file: the lean loader's path
    prompt = AutoTokenizer.from_pretrained(str(small_f32))("the quick brown fox")["input_ids"]
    engine.add(GenerateRequest(request_id="r", trajectory_id="t", prompt_token_ids=Int32Array(prompt),
                               max_new_tokens=4, temperature=1.0, top_p=1.0, seed=0))
    results = []
    while engine.has_work():
        results += engine.step()
    [r] = results
    assert r.finish_reason in ("length", "stop") and 1 <= len(r.token_ids.tolist()) <= 4


def test_the_seed_decides_the_weights_and_dtype_the_saved_tensors(tmp_path_factory, small_f32):
    again = build(tmp_path_factory, "again", dtype="float32", seed=0)
    for name in ("model.safetensors", "config.json", "tokenizer.json", model_shapes.SHAPE_FILE):
        assert (again / name).read_bytes() == (small_f32 / name).read_bytes(), name
    other = tensors(build(tmp_path_factory, "seed1", dtype="float32", seed=1))
    same = tensors(small_f32)
    assert not torch.equal(other["model.embed_tokens.weight"], same["model.embed_tokens.weight"])
    assert not torch.equal(other["model.layers.1.mlp.up_proj.weight"], same["model.layers.1.mlp.up_proj.weight"])
    bf16 = tensors(build(tmp_path_factory, "bf16", dtype="bfloat16", seed=0))
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}


def test_a_sharded_folder_loads_the_same_weights(tmp_path_factory, small_f32):
    from transformers import AutoModelForCausalLM

    sharded = build(tmp_path_factory, "sharded", dtype="float32", seed=0, max_shard_size="10MB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 1
    model = AutoModelForCausalLM.from_pretrained(str(sharded), dtype=torch.float32)
    whole = tensors(small_f32)
    for name, param in model.state_dict().items():
        if name in whole:
            assert torch.equal(param, whole[name]), name
