"""Weights published in `[model] dtype` = bfloat16 (common/tensors.py): the trainer's copy
is bfloat16 (half the bytes of float32), the relay's manifest keeps the dtype through its
JSON and its byte range, and the torch engine loads the version bit for bit, in bfloat16
or upcast into a float32 engine."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rlfleet.common.tensors import BFLOAT16, is_float, to_numpy, to_torch
from rlfleet.daemons.rollout.engines.torch_engine import TorchEngine
from rlfleet.daemons.trainer.learner import Learner
from rlfleet.relay.manifest import Manifest, build_manifest, tensor_views

TINY = Path(__file__).resolve().parents[3] / "models" / "tiny-qwen2"
needs_model = pytest.mark.skipif(not (TINY / "model.safetensors").exists(), reason="models/tiny-qwen2 not built")


def test_a_tensor_crosses_as_its_bfloat16_bits():
    t = torch.randn(5, 7)
    a = to_numpy(t, "bfloat16")
    assert a.dtype == BFLOAT16 and a.nbytes == t.numel() * 2 and is_float(a)
    assert torch.equal(to_torch(a), t.to(torch.bfloat16))
    assert to_numpy(t).dtype == np.float32 and torch.equal(to_torch(to_numpy(t)), t)
    assert not is_float(np.zeros(3, dtype=np.int32))
    with pytest.raises(ValueError, match="cannot publish in 'float16'"):
        to_numpy(t, "float16")


def relayed(version: int, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What a rollout reads: the manifest through its JSON, the tensors from its byte range."""
    manifest, source = build_manifest(version, tensors, chunk_bytes=1 << 16)
    return tensor_views(Manifest.from_json(json.loads(json.dumps(manifest.to_json()))), source.to_bytearray())


@needs_model
def test_a_bfloat16_version_is_half_the_bytes_and_every_engine_loads_it_exactly():
    learner = Learner(TINY, seed=0)
    full, half = learner.state_tensors("float32"), learner.state_tensors("bfloat16")

    def published_bytes(tensors):  # a tied tensor is published once
        return sum(a.nbytes for a in {id(a): a for a in tensors.values()}.values())
    assert published_bytes(half) * 2 == published_bytes(full) > 0
    read = relayed(3, half)
    assert {name: a.dtype for name, a in read.items()} == dict.fromkeys(half, BFLOAT16)
    for dtype in ("bfloat16", "float32"):
        engine = TorchEngine.from_pretrained(TINY, max_batch=2, max_len=32, seed=0, dtype=dtype)
        engine.load_weights(3, read)
        mine = dict(engine.model.named_parameters())
        for name, param in learner.model.named_parameters():
            want = param.detach().to(torch.bfloat16).to(getattr(torch, dtype))
            assert torch.equal(mine[name], want), name
        assert engine.weight_version == 3
