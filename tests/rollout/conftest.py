"""Fixtures for the rollout tests: a tiny random Qwen2 built once per session.

Random weights and a fixed vocabulary on purpose: the tests check the engine against
the model's own forward and generate(), which holds for any weights, and they must not
depend on models/tiny-qwen2 being built or on the task tokenizer's alphabet.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # other engineers' tests share the 2 cores

VOCAB = 40  # ids 0 pad, 1 bos, 2 eos, 3 unk; prompts use 4..VOCAB-1


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("tiny-qwen2")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    Qwen2ForCausalLM(config).save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32,
                                                 attn_implementation="sdpa")
    return model.eval()
