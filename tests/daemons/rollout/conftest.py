"""Fixtures for the rollout tests: a tiny random Qwen2 built once per session.

Random weights and a fixed vocabulary on purpose: the tests check the engine against
the model's own forward and generate(), which holds for any weights, and they must not
depend on models/tiny-qwen2 being built or on the task tokenizer's alphabet.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_qwen2 import save_random_qwen2

torch.set_num_threads(1)  # other engineers' tests share the 2 cores

VOCAB = 40  # ids 0 pad, 1 bos, 2 eos, 3 unk; prompts use 4..VOCAB-1


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_random_qwen2(tmp_path_factory.mktemp("tiny-qwen2"), vocab=VOCAB, hidden=64, intermediate=256,
                             max_positions=256)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32,
                                                 attn_implementation="sdpa")
    return model.eval()


def run_all(engine, out: dict | None = None) -> dict:
    """Step ``engine`` until it has no work: its results by request id (each answered once)."""
    out = {} if out is None else out
    while engine.has_work():
        for r in engine.step():
            assert r.request_id not in out, f"{r.request_id} answered twice"
            out[r.request_id] = r
    return out
