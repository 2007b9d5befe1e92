"""TorchEngine in process: equivalence with generate(), continuous batching, aborts,
KV accounting, log-probs, weight versions and refused requests."""

from __future__ import annotations

import copy
import math
import random

import numpy as np
import pytest
import torch

from rlfleet.common.wire.arrays import Int32Array
from rlfleet.common.wire.messages import GenerateRequest, GenerateResult
from rlfleet.daemons.rollout.engines.forward import LeanForward, ModelForward
from rlfleet.daemons.rollout.engines.slots import sample_rows
from rlfleet.daemons.rollout.engines.torch_engine import TorchEngine

from .conftest import VOCAB, run_all


def req(rid: str, prompt: list[int], max_new: int = 8, temperature: float = 0.0,
        top_p: float = 1.0, seed: int | None = None) -> GenerateRequest:
    return GenerateRequest(request_id=rid, trajectory_id="t", prompt_token_ids=Int32Array(prompt),
                           max_new_tokens=max_new, temperature=temperature, top_p=top_p, seed=seed)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 25) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(4, VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]



@torch.inference_mode()
def greedy_reference(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def full_forward_logprobs(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """log softmax at temperature 1 of each generated token, recomputed without any cache."""
    ids = torch.tensor([prompt + tokens])
    logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    return logp[pos, torch.tensor(tokens)].numpy()


def test_greedy_alone_equals_generate(tiny_model):
    engine = TorchEngine(tiny_model, max_batch=4, max_len=64)
    for i, p in enumerate(prompts(4, seed=1)):
        engine.add(req(f"r{i}", p, max_new=20))
        result = run_all(engine)[f"r{i}"]
        assert result.token_ids.tolist() == greedy_reference(tiny_model, p, 20)
        assert result.finish_reason == "length" and result.weight_version == 0


def test_greedy_with_requests_joining_and_leaving_mid_batch(tiny_model):
    """7 requests through 3 slots, added at different steps, one aborted: every finished
    request still equals generate(do_sample=False) of its prompt alone."""
    engine = TorchEngine(tiny_model, max_batch=3, max_len=64)
    ps = prompts(7, seed=2)
    max_new = [5, 17, 9, 3, 12, 20, 7]
    schedule = {0: [0, 1], 2: [2, 3], 4: [4], 6: [5, 6]}  # step -> requests added before it
    results: dict[str, GenerateResult] = {}
    running_seen = set()
    step = 0
    while step <= max(schedule) or engine.has_work():
        for i in schedule.get(step, []):
            engine.add(req(f"r{i}", ps[i], max_new=max_new[i]))
        if step == 5:  # r1 leaves mid-generation; its slot is reused
            aborted = engine.abort("r1")
            assert aborted is not None and aborted.finish_reason == "abort"
            assert 0 < len(aborted.token_ids) < max_new[1]
            assert aborted.token_ids.tolist() == greedy_reference(tiny_model, ps[1], max_new[1])[:len(aborted.token_ids)]
        for r in engine.step():
            results[r.request_id] = r
        running_seen.add(engine.stats().running)
        step += 1
    assert running_seen >= {1, 2, 3}, running_seen  # the batch really grew and shrank
    assert sorted(results) == ["r0", "r2", "r3", "r4", "r5", "r6"]
    for i in [0, 2, 3, 4, 5, 6]:
        assert results[f"r{i}"].token_ids.tolist() == greedy_reference(tiny_model, ps[i], max_new[i]), i


def test_logprobs_match_full_forward_at_temperature_one(tiny_model):
    engine = TorchEngine(tiny_model, max_batch=4, max_len=64, seed=0)
    ps = prompts(4, seed=3)
    settings = [(0.0, 1.0, None), (0.7, 0.9, 11), (1.0, 1.0, 12), (1.5, 0.5, None)]
    for i, (p, (t, top_p, seed)) in enumerate(zip(ps, settings)):
        engine.add(req(f"r{i}", p, max_new=16, temperature=t, top_p=top_p, seed=seed))
    results = run_all(engine)
    for i, p in enumerate(ps):
        r = results[f"r{i}"]
        ref = full_forward_logprobs(tiny_model, p, r.token_ids.tolist())
        np.testing.assert_allclose(r.logprobs.numpy(), ref, atol=1e-4)


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_model):
    p = prompts(1, seed=4)[0]
    alone = TorchEngine(tiny_model, max_batch=4, max_len=64)
    alone.add(req("s", p, max_new=24, temperature=1.0, seed=1234))
    tokens_alone = run_all(alone)["s"].token_ids.tolist()
    batched = TorchEngine(tiny_model, max_batch=4, max_len=64)
    for i, q in enumerate(prompts(3, seed=5)):
        batched.add(req(f"o{i}", q, max_new=10, temperature=1.0))
    batched.step()
    batched.add(req("s", p, max_new=24, temperature=1.0, seed=1234))
    assert run_all(batched)["s"].token_ids.tolist() == tokens_alone
    other_seed = TorchEngine(tiny_model, max_batch=1, max_len=64)
    other_seed.add(req("s", p, max_new=24, temperature=1.0, seed=99))
    assert run_all(other_seed)["s"].token_ids.tolist() != tokens_alone


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    u = torch.tensor([0.0, 0.55, 0.9, 0.999999])
    # top_p 0.7: nucleus {0, 1} (mass before token 1 is 0.5 < 0.7, before token 2 is 0.8)
    picked = sample_rows(logits, [0.7] * 4, u)
    assert picked.tolist() == [0, 0, 1, 1]
    assert sample_rows(logits, [1.0] * 4, u).tolist() == [0, 1, 2, 3]
    assert sample_rows(logits, [1e-6] * 4, u).tolist() == [0, 0, 0, 0]  # tiny top_p = greedy


def test_tiny_top_p_sampling_equals_greedy(tiny_model):
    p = prompts(1, seed=6)[0]
    engine = TorchEngine(tiny_model, max_batch=1, max_len=64)
    engine.add(req("x", p, max_new=16, temperature=1.3, top_p=1e-6, seed=3))
    assert run_all(engine)["x"].token_ids.tolist() == greedy_reference(tiny_model, p, 16)


def test_eos_stops_and_is_included(tiny_model):
    p = prompts(1, seed=7)[0]
    ref = greedy_reference(tiny_model, p, 12)
    eos = ref[4]
    engine = TorchEngine(tiny_model, max_batch=2, max_len=64, eos_token_ids={eos})
    engine.add(req("e", p, max_new=12))
    r = run_all(engine)["e"]
    assert r.finish_reason == "stop"
    assert r.token_ids.tolist() == ref[:ref.index(eos) + 1]


def test_abort_frees_a_slot_for_a_waiting_request(tiny_model):
    a, b = prompts(2, seed=8)
    engine = TorchEngine(tiny_model, max_batch=1, max_len=64)
    engine.add(req("a", a, max_new=30))
    engine.add(req("b", b, max_new=5))
    for _ in range(3):
        assert engine.step() == []
    s = engine.stats()
    assert (s.running, s.waiting) == (1, 1)
    aborted = engine.abort("a")
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) == 3 == len(aborted.logprobs)
    assert engine.stats().running == 0 and engine.stats().kv_used == 0
    engine.step()
    assert engine.running_ids() == ["b"]  # admitted into the freed slot on the next step
    assert engine.abort("a") is None  # already gone
    engine.add(req("c", a, max_new=5))
    waiting_abort = engine.abort("c")
    assert waiting_abort.finish_reason == "abort" and len(waiting_abort.token_ids) == 0
    results = run_all(engine)
    assert sorted(results) == ["b"]
    assert results["b"].token_ids.tolist() == greedy_reference(tiny_model, b, 5)


def test_kv_usage_goes_up_and_down(tiny_model):
    engine = TorchEngine(tiny_model, max_batch=4, max_len=50)
    assert engine.stats().kv_total == 4 * 50
    assert engine.stats().kv_used == 0
    p1, p2 = prompts(2, seed=9)
    engine.add(req("a", p1, max_new=6))
    engine.add(req("b", p2, max_new=3))
    used = []
    while engine.has_work():
        engine.step()
        used.append(engine.stats().kv_used)
    # after the first step both prompts are cached; each step adds one token per request
    assert used[0] == len(p1) + len(p2)
    assert used[1] == used[0] + 2
    assert max(used) > used[0]
    assert used[-1] == 0  # everything finished: the cache is free again
    assert engine.stats().tokens_per_s > 0


def test_weight_version_changes_only_between_requests(tiny_model):
    model = copy.deepcopy(tiny_model)
    engine = TorchEngine(model, max_batch=2, max_len=64)
    p = prompts(1, seed=10)[0]
    engine.add(req("v0", p, max_new=10))
    engine.step()
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    new = {k: (v * 1.5).astype(np.float32) for k, v in state.items()}
    with pytest.raises(RuntimeError, match="running"):
        engine.load_weights(1, new)
    r0 = run_all(engine)["v0"]
    assert r0.weight_version == 0

    # refused loads leave the version and the weights alone
    bad_shape = dict(new, **{"model.norm.weight": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight: shape \(3,\) dtype float32, model has shape \(64,\)"):
        engine.load_weights(1, bad_shape)
    as_ints = dict(new, **{"model.norm.weight": np.zeros(64, np.int32)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight: shape \(64,\) dtype int32"):
        engine.load_weights(1, as_ints)
    with pytest.raises(ValueError, match="missing tensor"):
        engine.load_weights(1, {k: v for k, v in new.items() if "layers.1.mlp" not in k})
    with pytest.raises(ValueError, match="unknown tensor"):
        engine.load_weights(1, dict(new, bogus=np.zeros(1, np.float32)))
    assert engine.weight_version == 0
    np.testing.assert_array_equal(model.model.norm.weight.detach().numpy(), state["model.norm.weight"])

    ro = {k: v.copy() for k, v in new.items()}
    for v in ro.values():
        v.flags.writeable = False  # the relay's shared memory is read-only
    engine.load_weights(1, ro)
    engine.add(req("v1", p, max_new=10))
    r1 = run_all(engine)["v1"]
    assert r1.weight_version == 1
    np.testing.assert_allclose(model.model.norm.weight.detach().numpy(), new["model.norm.weight"])
    ref = full_forward_logprobs(model, p, r1.token_ids.tolist())
    np.testing.assert_allclose(r1.logprobs.numpy(), ref, atol=1e-4)
    assert not np.allclose(r1.logprobs.numpy()[:1], r0.logprobs.numpy()[:1])  # new weights in use


@pytest.mark.parametrize("bad, reason", [
    (dict(prompt=[]), "prompt_token_ids is empty"),
    (dict(prompt=[1] * 60, max_new=10), "prompt of 60 tokens + max_new_tokens 10 exceeds the cache length 64"),
    (dict(temperature=-0.5), "temperature must be finite and >= 0 (0 = greedy), got -0.5"),
    (dict(temperature=math.nan), "temperature must be finite"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(prompt=[1, VOCAB]), f"prompt token id out of range [0, {VOCAB}): min 1, max {VOCAB}"),
    (dict(prompt=[1, -3]), "prompt token id out of range"),
    (dict(max_new=0), "max_new_tokens must be >= 1, got 0"),
    (dict(seed=-1), "seed must be in [0, 2**63), got -1"),
])
def test_bad_requests_are_answered_as_errors(tiny_model, bad, reason):
    engine = TorchEngine(tiny_model, max_batch=2, max_len=64)
    kwargs = dict(prompt=[1, 5, 6], max_new=4)
    kwargs.update(bad)
    engine.add(req("bad", kwargs.pop("prompt"), **kwargs))
    engine.add(req("good", [1, 5, 6], max_new=4))
    results = run_all(engine)
    assert results["bad"].finish_reason == "error"
    assert reason in results["bad"].error
    assert len(results["bad"].token_ids) == 0
    assert results["good"].finish_reason == "length" and len(results["good"].token_ids) == 4


def test_duplicate_request_id_is_refused_and_the_first_runs_on(tiny_model):
    engine = TorchEngine(tiny_model, max_batch=2, max_len=64)
    engine.add(req("dup", [1, 5, 6], max_new=4))
    engine.add(req("dup", [1, 7, 8], max_new=4))
    out = engine.step()
    assert [(r.request_id, r.finish_reason) for r in out] == [("dup", "error")]
    assert "already waiting or running" in out[0].error
    assert run_all(engine)["dup"].token_ids.tolist() == greedy_reference(tiny_model, [1, 5, 6], 4)


def test_prefill_budget_admits_long_prompts_over_several_steps(tiny_model):
    engine = TorchEngine(tiny_model, max_batch=4, max_len=64, max_prefill_tokens=30)
    ps = [[1] + [5] * 19, [1] + [6] * 19, [1] + [7] * 19]
    for i, p in enumerate(ps):
        engine.add(req(f"r{i}", p, max_new=3))
    engine.step()
    assert engine.stats().running == 1 and engine.stats().waiting == 2
    results = run_all(engine)
    for i, p in enumerate(ps):
        assert results[f"r{i}"].token_ids.tolist() == greedy_reference(tiny_model, p, 3)


def test_the_tiny_qwen2_runs_the_lean_forward_and_the_model_path_stays_available(tiny_model):
    assert isinstance(TorchEngine(tiny_model, max_batch=2, max_len=64).forward, LeanForward)
    assert isinstance(TorchEngine(tiny_model, max_batch=2, max_len=64, lean=False).forward, ModelForward)


@pytest.mark.parametrize("lean", [True, False])
def test_decode_and_prefill_share_a_step_on_both_forwards(tiny_model, lean):
    """A request joining while others decode: one forward for the step on the lean pass
    (two on the model's own), and every answer still equals generate() alone."""
    engine = TorchEngine(tiny_model, max_batch=4, max_len=64, lean=lean)
    ps = prompts(4, seed=11)
    engine.add(req("a", ps[0], max_new=9))
    engine.add(req("b", ps[1], max_new=6))
    engine.step()
    calls = engine.forward.calls
    engine.add(req("c", ps[2], max_new=7))
    engine.add(req("d", ps[3], max_new=5))
    engine.step()  # a, b decode; c, d (different prompt lengths) prefill
    assert engine.forward.calls - calls == (1 if lean else 2)
    results = run_all(engine)
    for rid, p, n in zip("abcd", ps, [9, 6, 7, 5]):
        assert results[rid].token_ids.tolist() == greedy_reference(tiny_model, p, n), rid
        ref = full_forward_logprobs(tiny_model, p, results[rid].token_ids.tolist())
        np.testing.assert_allclose(results[rid].logprobs.numpy(), ref, atol=1e-4)


def test_a_lean_forward_that_disagrees_is_not_used(tiny_model, monkeypatch):
    right = LeanForward.__call__
    monkeypatch.setattr(LeanForward, "__call__", lambda self, *a: right(self, *a) * 1.01)
    engine = TorchEngine(tiny_model, max_batch=2, max_len=64)
    assert isinstance(engine.forward, ModelForward)
    p = prompts(1, seed=12)[0]
    engine.add(req("x", p, max_new=6))
    assert run_all(engine)["x"].token_ids.tolist() == greedy_reference(tiny_model, p, 6)


@pytest.mark.parametrize("lean", [True, False])
def test_requests_sharing_a_prompt_copy_its_cache_and_match_generate(tiny_model, lean):
    """A GRPO group: same prompt, in one step and in later steps (also after its first
    holder finished and rows moved): prefilled once while a holder runs, answers equal
    generate() and the full forward's log-probs, KV usage counts every copy."""
    engine = TorchEngine(tiny_model, max_batch=6, max_len=64, lean=lean)
    shared, other = prompts(2, seed=13)
    prefilled = []
    real_forward = engine.forward

    def spy(dec_ids, dec_pos, pre_ids, pre_last):
        prefilled.append(0 if pre_ids is None else pre_ids.shape[0])
        return real_forward(dec_ids, dec_pos, pre_ids, pre_last)

    engine.forward = spy
    engine.add(req("s0", shared, max_new=3))   # its holder finishes first
    engine.add(req("o0", other, max_new=10))
    engine.add(req("s1", shared, max_new=9))
    engine.add(req("s2", shared, max_new=5, temperature=1.0, seed=7))
    engine.step()
    assert prefilled == [2]  # shared and other; s1, s2 copied
    assert engine.stats().kv_used == 3 * len(shared) + len(other)
    results: dict[str, GenerateResult] = {}
    for r in engine.step() + engine.step() + engine.step():  # s0 finishes; rows move
        results[r.request_id] = r
    assert "s0" in results
    assert {"s1", "o0"} <= set(engine.running_ids())
    engine.add(req("s3", shared, max_new=6))  # copies from s1 (s0, the first holder, is gone)
    engine.add(req("n0", other, max_new=4))   # copies from o0
    run_all(engine, results)
    assert prefilled[4] == 0 and sum(prefilled) == 2
    for rid, p, n in [("s0", shared, 3), ("s1", shared, 9), ("o0", other, 10), ("s3", shared, 6),
                      ("n0", other, 4)]:
        assert results[rid].token_ids.tolist() == greedy_reference(tiny_model, p, n), rid
    for rid, p in [("s1", shared), ("s2", shared), ("n0", other), ("s3", shared)]:
        ref = full_forward_logprobs(tiny_model, p, results[rid].token_ids.tolist())
        np.testing.assert_allclose(results[rid].logprobs.numpy(), ref, atol=1e-4)
    alone = TorchEngine(tiny_model, max_batch=1, max_len=64, lean=lean)
    alone.add(req("s2", shared, max_new=5, temperature=1.0, seed=7))
    assert run_all(alone)["s2"].token_ids.tolist() == results["s2"].token_ids.tolist()
    assert engine.stats().kv_used == 0


def test_a_checkpoint_loaded_without_transformers_answers_as_through_transformers(tiny_model_dir, tiny_model):
    """lean_model.load reads the safetensors itself: same tokens, same log-probs, same
    state-dict names (a trainer's weights load into it), and no transformers model."""
    from rlfleet.daemons.rollout.engines.lean_model import LeanModel

    lean = TorchEngine.from_pretrained(tiny_model_dir, max_batch=4, max_len=64, seed=0)
    hf = TorchEngine.from_pretrained(tiny_model_dir, max_batch=4, max_len=64, seed=0, lean=False)
    assert isinstance(lean.model, LeanModel) and not isinstance(hf.model, LeanModel)
    assert isinstance(hf.forward, ModelForward)
    assert set(lean.model.state_dict()) == set(tiny_model.state_dict())
    assert lean.eos == hf.eos
    ps = prompts(4, seed=14)
    for engine in (lean, hf):
        for i, p in enumerate(ps):
            engine.add(req(f"r{i}", p, max_new=12, temperature=[0.0, 1.0][i % 2], seed=i))
    a, b = run_all(lean), run_all(hf)
    for i in range(len(ps)):
        assert a[f"r{i}"].token_ids.tolist() == b[f"r{i}"].token_ids.tolist()
        np.testing.assert_allclose(a[f"r{i}"].logprobs.numpy(), b[f"r{i}"].logprobs.numpy(), atol=1e-5)
    new = {k: (v.detach().numpy() * 0.5).astype(np.float32) for k, v in tiny_model.state_dict().items()}
    lean.load_weights(1, new)
    lean.add(req("w", ps[0], max_new=8))
    r = run_all(lean)["w"]
    scaled = copy.deepcopy(tiny_model)
    scaled.load_state_dict({k: torch.from_numpy(v) for k, v in new.items()})
    np.testing.assert_allclose(r.logprobs.numpy(), full_forward_logprobs(scaled, ps[0], r.token_ids.tolist()),
                               atol=1e-4)
