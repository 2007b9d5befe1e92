"""Random Qwen2 checkpoints for the tests: small, built in a second, never the shipped
models/tiny-qwen2 (a test's numbers must not move when that one is rebuilt)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save_random_qwen2(out: Path, *, vocab: int, hidden: int, intermediate: int, max_positions: int,
                      seed: int = 0, **overrides: Any) -> Path:
    """A random Qwen2 saved at ``out``: 2 layers, 4 attention heads sharing 2 key/value
    heads, tied embeddings, ids 0 pad / 1 bos / 2 eos, unless ``overrides`` says otherwise."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    Qwen2ForCausalLM(Qwen2Config(**{**config, **overrides})).save_pretrained(str(out))
    return out
