"""The sim rollout engine: its timing model against hand-computed times, its scheduling
against a step-by-step reference, its lengths and tokens, and its spec table.

Times are dyadic fractions (1/64 s, ...) so that sums are exact in binary floating point.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

import pytest

from rlfleet.common.spec.errors import SpecError
from rlfleet.common.spec.job import load_spec, parse_spec
from rlfleet.common.spec.seams import ROLLOUT_ENGINES
from rlfleet.common.wire.arrays import Int32Array
from rlfleet.common.wire.messages import GenerateRequest
from rlfleet.daemons.rollout.engines.kinds import SimEngineConfig
from rlfleet.daemons.rollout.sim.engine import SimEngine
from rlfleet.daemons.rollout.sim.lengths import LengthModel, Lognormal, Trace, length_keys, load_trace
from rlfleet.daemons.rollout.sim.timing import PROFILES, SimTiming

VOCAB, EOS, SEED = 50, 7, 11


class Clock:
    """A fake wall clock the test moves by hand."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Fixed(LengthModel):
    """Lengths by trajectory id (through the member key the engine hashes)."""

    def __init__(self, lengths: dict[str, int], seed: int = SEED) -> None:
        self.by_key = {length_keys(seed, b"", tid)[1]: n for tid, n in lengths.items()}

    def length(self, group_key: int, member_key: int) -> int:
        return self.by_key[member_key]


def timing(**kw) -> SimTiming:
    base = dict(base_s=1 / 64, roofline_batch=4, kv_s_per_token=0.0, prefill_s_per_token=0.0,
                kv_capacity_tokens=100_000, max_batch=64, load_s=1.0)
    return SimTiming(**{**base, **kw})


def engine(lengths: LengthModel | dict[str, int], clock: Clock, seed: int = SEED,
           time_scale: float = 1.0, **kw) -> SimEngine:
    model = Fixed(lengths, seed) if isinstance(lengths, dict) else lengths
    return SimEngine(timing(**kw), model, vocab_size=VOCAB, eos_token_id=EOS, seed=seed,
                     time_scale=time_scale, clock=clock)


def req(tid: str, prompt=(1, 2, 3, 4), max_new: int = 1000, rid: str | None = None,
        prefix: int = 0) -> GenerateRequest:
    return GenerateRequest(request_id=rid or f"req-{tid}", trajectory_id=tid,
                           prompt_token_ids=Int32Array(list(prompt)), max_new_tokens=max_new,
                           temperature=1.0, top_p=1.0, prefix_tokens=prefix)


def run_to_end(e: SimEngine, clock: Clock) -> dict[str, tuple[float, object]]:
    """Jump from event to event; every result with the wall time step() returned it."""
    out = {}
    while e.has_work():
        clock.t = e.next_event_at()
        for r in e.step():
            out[r.request_id] = (clock.t, r)
    return out


# ----------------------------------------------------------------------------- timing
def test_latency_is_flat_up_to_the_roofline_batch_and_linear_beyond():
    for n, step in ((1, 1 / 64), (4, 1 / 64), (8, 2 / 64), (16, 4 / 64)):
        clock = Clock()
        e = engine({f"t{i}": 10 for i in range(n)}, clock)
        for i in range(n):
            e.add(req(f"t{i}"))
        assert e.next_event_at() == 10 * step
        done = run_to_end(e, clock)
        assert {t for t, _ in done.values()} == {10 * step}, n
        assert {len(r.token_ids) for _, r in done.values()} == {10}


def test_kv_term_grows_each_step_with_the_tokens_held():
    clock = Clock()
    e = engine({"a": 3}, clock, kv_s_per_token=1 / 1024)
    e.add(req("a", prompt=(1, 2, 3, 4, 5)))
    # Steps read 5, 6, 7 KV tokens: 3/64 + (5 + 6 + 7)/1024.
    assert e.next_event_at() == 3 / 64 + 18 / 1024
    (t, r), = run_to_end(e, clock).values()
    assert t == 3 / 64 + 18 / 1024 and r.first_token_s == 1 / 64 + 5 / 1024


def test_prefill_is_added_to_the_step_that_admits_and_a_continuation_prefills_its_prefix():
    clock = Clock()
    e = engine({"a": 3, "b": 5}, clock, prefill_s_per_token=1 / 256)
    e.add(req("a", prompt=(1, 2, 3, 4)))
    e.add(req("b", prompt=(1, 2, 3, 4, 5, 6, 7, 8), prefix=2))  # b's turn: 2 done, 3 to go
    # One step admits both: 12 prompt tokens prefilled in the first step.
    done = run_to_end(e, clock)
    assert done["req-a"][0] == 12 / 256 + 3 / 64
    assert done["req-a"][1].first_token_s == done["req-b"][1].first_token_s == 12 / 256 + 1 / 64
    assert done["req-b"][0] == 12 / 256 + 3 / 64 and len(done["req-b"][1].token_ids) == 3


def test_time_scale_shrinks_every_constant():
    clock = Clock()
    e = engine({"a": 8}, clock, time_scale=0.25, kv_s_per_token=1 / 1024, prefill_s_per_token=1 / 256)
    e.add(req("a"))
    # (4 prompt tokens * 1/256 + 8/64 + (4+5+...+11)/1024) model seconds, a quarter of that wall.
    assert e.next_event_at() == pytest.approx(0.25 * (4 / 256 + 8 / 64 + 60 / 1024), rel=1e-12)


def test_a_request_added_mid_step_joins_at_the_next_step_boundary():
    clock = Clock()
    e = engine({"a": 10, "b": 2}, clock)
    e.add(req("a"))
    clock.t = 2.5 / 64  # during a's third step
    e.add(req("b"))
    assert e.next_event_at() == 3 / 64  # the boundary where b joins
    done = run_to_end(e, clock)
    assert done["req-b"][0] == 5 / 64 and done["req-a"][0] == 10 / 64
    assert done["req-b"][1].first_token_s == 4 / 64 - 2.5 / 64


# ----------------------------------------------------------------------------- KV capacity
def test_admission_is_limited_by_kv_capacity_and_max_batch():
    clock = Clock()
    lengths = {f"t{i}": 5 for i in range(4)}
    e = engine(lengths, clock, kv_capacity_tokens=30)
    for i in range(3):
        e.add(req(f"t{i}", prompt=range(10), max_new=10))
    # 10+1 <= 30, 20+2 <= 30, 30+3 > 30: two run, one waits.
    s = e.stats()
    assert (s.running, s.waiting, s.kv_used, s.kv_total) == (2, 1, 20, 30)
    clock.t = 3 / 64
    assert e.stats().kv_used == 26  # two more tokens per step
    done = run_to_end(e, clock)
    assert [done[f"req-t{i}"][0] for i in range(3)] == [5 / 64, 5 / 64, 10 / 64]

    clock = Clock()
    e = engine(lengths, clock, max_batch=2)
    for i in range(4):
        e.add(req(f"t{i}"))
    assert (e.stats().running, e.stats().waiting) == (2, 2)
    assert sorted(t for t, _ in run_to_end(e, clock).values()) == [5 / 64] * 2 + [10 / 64] * 2


def test_kv_overflow_preempts_the_latest_admitted_which_recomputes_and_keeps_its_tokens():
    clock = Clock()
    e = engine({"a": 20, "b": 20}, clock, kv_capacity_tokens=30, prefill_s_per_token=1 / 1024)
    e.add(req("a", prompt=range(10), max_new=20))
    e.add(req("b", prompt=range(10), max_new=20))
    # 20 held + 2 per step: at step 5 the cache is full (30); b, the latest, is preempted
    # with 5 tokens. Re-admitting it needs 15 + 15 + 2 > 30: it waits until a finishes.
    t0 = 20 / 1024  # both prompts prefilled in the first step
    clock.t = t0 + 5 / 64
    s = e.stats()
    assert (s.running, s.waiting, s.kv_used) == (1, 1, 15)
    done = run_to_end(e, clock)
    assert done["req-a"][0] == t0 + 20 / 64
    # b re-prefills prompt + its 5 tokens, then makes its last 15.
    assert done["req-b"][0] == t0 + 20 / 64 + 15 / 1024 + 15 / 64
    alone = engine({"b": 20}, Clock())
    alone.add(req("b", prompt=range(10), max_new=20))
    (_, ref), = run_to_end(alone, alone.clock).values()
    assert done["req-b"][1].token_ids.tolist() == ref.token_ids.tolist()
    assert done["req-b"][1].first_token_s == t0 + 1 / 64  # its first admission's


class Reference:
    """The same scheduling rules, one Python iteration per step: the closed-form jumps
    must give the same finish times."""

    def __init__(self, t: SimTiming, arrivals: list[tuple[float, str, int, int]]) -> None:
        self.t, self.arrivals = t, sorted(arrivals)
        self.preemptions = 0

    def run(self) -> dict[str, float]:
        t, cap = self.t, self.t.kv_capacity_tokens
        pending = list(self.arrivals)  # (time, id, prompt, length)
        waiting: list[list] = []  # [id, prompt, length, generated]
        running: list[list] = []
        now, done = 0.0, {}
        while pending or waiting or running:
            while pending and pending[0][0] <= now:
                _, rid, p, n = pending.pop(0)
                waiting.append([rid, p, n, 0])
            if not running and not waiting:
                now = pending[0][0]
                continue
            for r in [r for r in running if r[3] == r[2]]:
                running.remove(r)
                done[r[0]] = now
            kv = sum(r[1] + r[3] for r in running)
            while running and kv + len(running) > cap:
                r = running.pop()
                kv -= r[1] + r[3]
                waiting.insert(0, r)
                self.preemptions += 1
            prefill = 0
            while waiting and len(running) < t.max_batch:
                need = waiting[0][1] + waiting[0][3]
                if kv + need + len(running) + 1 > cap:
                    break
                running.append(waiting.pop(0))
                kv += need
                prefill += need
            if not running:
                continue
            now += (prefill * t.prefill_s_per_token
                    + t.base_s * max(1, len(running) / t.roofline_batch) + t.kv_s_per_token * kv)
            for r in running:
                r[3] += 1
        return done


def test_closed_form_jumps_match_a_step_by_step_reference_with_arrivals_and_preemption():
    rng = random.Random(5)
    t = timing(kv_s_per_token=1 / 4096, prefill_s_per_token=1 / 8192, kv_capacity_tokens=900,
               max_batch=12)
    arrivals = [(round(rng.uniform(0, 3), 3), f"t{i}", rng.randint(1, 40), rng.randint(1, 150))
                for i in range(60)]
    reference = Reference(t, arrivals)
    expected = reference.run()
    assert reference.preemptions > 5  # the cache overflows: preemption is exercised
    clock = Clock()
    e = SimEngine(t, Fixed({tid: n for _, tid, _, n in arrivals}), vocab_size=VOCAB,
                  eos_token_id=EOS, seed=SEED, clock=clock)
    got: dict[str, float] = {}
    todo = sorted(arrivals)
    while todo or e.has_work():
        nxt = e.next_event_at()
        if todo and (nxt is None or todo[0][0] <= nxt):
            clock.t, tid, p, _ = todo.pop(0)
            e.add(req(tid, prompt=range(p), max_new=200))
            continue
        clock.t = nxt
        for r in e.step():
            got[r.request_id.removeprefix("req-")] = clock.t
            assert len(r.token_ids) == expected_len(arrivals, r.request_id)
    assert got.keys() == expected.keys()
    for tid in expected:
        assert got[tid] == pytest.approx(expected[tid], rel=1e-9, abs=1e-12), tid
    assert e.lag_fraction() == 0.0 and e.max_late_s == 0.0


def expected_len(arrivals, rid: str) -> int:
    return next(n for _, tid, _, n in arrivals if f"req-{tid}" == rid)


# ----------------------------------------------------------------------------- tokens
def test_tokens_stop_with_eos_or_at_the_cap_and_are_deterministic_per_seed():
    lengths = Lognormal(median=40, p99=200, group_correlation=0.5)
    runs = []
    for seed in (SEED, SEED, SEED + 1):
        clock = Clock()
        e = engine(lengths, clock, seed=seed)
        for i in range(20):
            e.add(req(f"t{i}", max_new=60))
        runs.append({k: (r.token_ids.tolist(), r.logprobs.tolist(), r.finish_reason)
                     for k, (_, r) in run_to_end(e, clock).items()})
    assert runs[0] == runs[1] and runs[0] != runs[2]
    reasons = {reason for _, _, reason in runs[0].values()}
    assert reasons == {"stop", "length"}
    for tokens, logprobs, reason in runs[0].values():
        assert all(0 <= x < VOCAB for x in tokens) and EOS not in tokens[:-1]
        assert (tokens[-1] == EOS) == (reason == "stop") and len(tokens) <= 60
        assert len(tokens) == 60 or reason == "stop"
        assert all(math.isfinite(lp) and lp < 0 for lp in logprobs)


def test_abort_returns_exactly_the_tokens_due_and_a_continuation_goes_on_with_the_same_tokens():
    lengths = Lognormal(median=300, p99=600, group_correlation=0.5)
    prompt = (3, 1, 4, 1, 5)
    whole_engine = engine(lengths, Clock())
    whole_engine.add(req("x", prompt=prompt))
    (_, whole), = run_to_end(whole_engine, whole_engine.clock).values()
    n = len(whole.token_ids)
    assert n > 20 and whole.finish_reason == "stop"

    clock = Clock()
    e = engine(lengths, clock)
    e.add(req("x", prompt=prompt))
    clock.t = 17.5 / 64
    part = e.abort("req-x")
    assert part.finish_reason == "abort" and part.token_ids.tolist() == whole.token_ids.tolist()[:17]
    assert part.logprobs.tolist() == whole.logprobs.tolist()[:17]
    assert e.abort("req-x") is None and not e.has_running() and not e.has_work()
    # An abort exactly at a step boundary has that step's token.
    e2 = engine(lengths, Clock())
    e2.add(req("x", prompt=prompt))
    e2.clock.t = 17 / 64
    assert len(e2.abort("req-x").token_ids) == 17

    # The rest of the turn, on another engine with the same seed: prompt + the 17 tokens.
    other = engine(lengths, Clock())
    other.add(req("x", prompt=prompt + tuple(part.token_ids.tolist()), max_new=1000 - 17, prefix=17))
    (_, rest), = run_to_end(other, other.clock).values()
    assert part.token_ids.tolist() + rest.token_ids.tolist() == whole.token_ids.tolist()
    assert rest.finish_reason == "stop"
    # ... also when the whole turn ends at its cap.
    capped = engine(lengths, Clock())
    capped.add(req("x", prompt=prompt + tuple(part.token_ids.tolist()), max_new=3, prefix=17))
    (_, end), = run_to_end(capped, capped.clock).values()
    assert end.finish_reason == "length" and end.token_ids.tolist() == whole.token_ids.tolist()[17:20]


def test_abort_of_a_waiting_request_and_of_one_of_several_running():
    clock = Clock()
    e = engine({"a": 10, "b": 10, "c": 4}, clock, max_batch=2)
    for tid in "abc":
        e.add(req(tid))
    assert e.abort("req-c").token_ids.tolist() == []  # waiting: nothing generated
    clock.t = 3.5 / 64
    assert len(e.abort("req-b").token_ids) == 3
    assert e.running_ids() == ["req-a"] and e.has_running()
    done = run_to_end(e, clock)
    assert list(done) == ["req-a"] and done["req-a"][0] == 10 / 64


# ----------------------------------------------------------------------------- events, loads, lag
def test_next_event_at_is_exact():
    clock = Clock(100.0)
    e = engine({"a": 37, "b": 90}, clock, kv_s_per_token=1 / 3000, prefill_s_per_token=1 / 5000)
    assert e.next_event_at() is None
    e.add(req("a", prompt=range(13)))
    e.add(req("b", prompt=range(7)))
    due = e.next_event_at()
    # 20 prompt tokens prefilled; 37 steps of 2 requests from 20 KV tokens.
    assert due == pytest.approx(100 + 20 / 5000 + 37 / 64 + (37 * 20 + 2 * 37 * 36 / 2) / 3000, rel=1e-12)
    clock.t = math.nextafter(due, 0)
    assert e.step() == []
    clock.t = due
    assert [r.request_id for r in e.step()] == ["req-a"]
    assert e.next_event_at() > due


def test_load_weights_refused_while_running_and_busy_for_load_s():
    clock = Clock()
    e = engine({"a": 4, "b": 4}, clock, load_s=0.5)
    e.add(req("a"))
    with pytest.raises(RuntimeError, match="1 running request"):
        e.load_weights(3, {})
    run_to_end(e, clock)
    assert e.weight_version == 0
    e.load_weights(3, {})
    assert e.weight_version == 3 and e.next_event_at() == clock.t + 0.5
    t_load = clock.t
    clock.t += 0.25
    e.add(req("b"))  # waits for the load
    assert (e.stats().running, e.stats().waiting) == (0, 1)
    done = run_to_end(e, clock)
    assert done["req-b"][0] == t_load + 0.5 + 4 / 64
    assert done["req-b"][1].weight_version == 3
    assert done["req-b"][1].first_token_s == 0.25 + 1 / 64


def test_lag_shows_when_step_is_called_late():
    clock = Clock()
    e = engine({"a": 64, "b": 64}, clock)
    e.add(req("a"))
    clock.t = 1.5  # 0.5 s after a was due
    assert len(e.step()) == 1
    assert e.max_late_s == 0.5 and e.lag_fraction() == 0.5 / 1.0
    e.add(req("b"))
    clock.t = e.next_event_at()
    e.step()
    assert e.lag_fraction() == 0.5 / 2.0 and e.results_delivered == 2


def test_accounting_idle_kv_utilization_generated_and_rate():
    clock = Clock()
    e = engine({"a": 4}, clock, kv_capacity_tokens=100, base_s=0.25)
    e.add(req("a", max_new=50))  # KV 4, 5, 6, 7 tokens for 0.25 s each
    clock.t = 0.5
    assert e.generated_tokens == 2 and e.stats().kv_used == 6
    assert e.kv_utilization_mean() == pytest.approx((4 + 5) * 0.25 / 100 / 0.5)
    run_to_end(e, clock)
    clock.t = 2.0
    assert e.kv_utilization_mean() == pytest.approx(22 * 0.25 / 100 / 2.0)
    assert e.idle_s == 1.0 and e.generated_tokens == 4
    assert e.stats().tokens_per_s == pytest.approx(4 / 2.0)


# ----------------------------------------------------------------------------- requests refused
@pytest.mark.parametrize(("request_", "reason"), [
    (GenerateRequest("", "a", Int32Array([1]), 5, 1.0, 1.0), "request_id is empty"),
    (req("a", prompt=()), "prompt_token_ids is empty"),
    (GenerateRequest("r", "a", Int32Array.frombuffer(bytes(16), shape=(2, 2)), 5, 1.0, 1.0),
     "prompt_token_ids must be 1-D, got shape (2, 2)"),
    (req("a", prompt=(1, VOCAB)), f"prompt token id out of range [0, {VOCAB}): min 1, max {VOCAB}"),
    (req("a", max_new=0), "max_new_tokens must be >= 1, got 0"),
    (req("a", prefix=4), "prefix_tokens must be in [0, 4) (the prompt's length), got 4"),
    (req("a", max_new=97), "prompt of 4 tokens + max_new_tokens 97 exceeds the KV capacity in tokens, 100"),
])
def test_bad_requests_come_back_as_errors_from_step(request_, reason):
    clock = Clock()
    e = engine({"a": 3}, clock, kv_capacity_tokens=100)
    e.add(request_)
    assert e.has_work() and e.next_event_at() == 0.0
    (r,) = e.step()
    assert (r.finish_reason, r.error) == ("error", reason)


def test_a_duplicate_id_is_refused():
    e = engine({"a": 3}, Clock())
    e.add(req("a"))
    e.add(req("a"))
    (r,) = e.step()
    assert r.error == "request_id 'req-a' is already waiting or running"


# ----------------------------------------------------------------------------- lengths
def test_lognormal_median_p99_group_correlation():
    model = Lognormal(median=1000, p99=8000, group_correlation=0.0)
    lengths = sorted(model.length(*length_keys(1, f"p{i}".encode(), f"t{i}")) for i in range(20_000))
    assert lengths[10_000] == pytest.approx(1000, rel=0.05)
    assert lengths[19_800] == pytest.approx(8000, rel=0.1)

    def spreads(rho: float) -> tuple[float, float]:
        m = Lognormal(median=1000, p99=8000, group_correlation=rho)
        groups = [[math.log(m.length(*length_keys(1, f"g{g}".encode(), f"g{g}-{i}"))) for i in range(8)]
                  for g in range(300)]
        within = statistics.mean(statistics.pvariance(g) for g in groups)
        across = statistics.pvariance([statistics.mean(g) for g in groups])
        return within, across

    within, across = spreads(0.9)
    assert within < across / 3
    within, across = spreads(0.0)
    assert across < within


def test_lengths_are_capped_at_the_turns_budget():
    clock = Clock()
    e = engine(Lognormal(median=5000, p99=6000, group_correlation=0.5), clock)
    for i in range(10):
        e.add(req(f"t{i}", max_new=30))
    done = run_to_end(e, clock)
    assert {(len(r.token_ids), r.finish_reason) for _, r in done.values()} == {(30, "length")}


def test_trace_lengths_come_from_the_prompts_group(tmp_path):
    path = tmp_path / "lengths.jsonl"
    path.write_text('{"lengths": [10, 11, 12]}\n\n{"length": 500}\n')
    groups = load_trace(path)
    assert groups == [[10, 11, 12], [500]]
    model = Trace(groups)
    seen: dict[int, set[int]] = {}
    for p in range(40):
        for i in range(8):
            g, m = length_keys(3, f"prompt{p}".encode(), f"{p}-{i}")
            seen.setdefault(p, set()).add(model.length(g, m))
    assert {frozenset(s) for s in seen.values()} >= {frozenset({500})}
    assert all(s <= {10, 11, 12} or s == {500} for s in seen.values())
    assert set().union(*seen.values()) == {10, 11, 12, 500}


# ----------------------------------------------------------------------------- profiles, spec
def test_profiles_follow_the_roofline_arithmetic():
    p7 = PROFILES["h800-7b"].timing
    # Qwen2.5-7B: 7.62e9 params, 15.2 GB bf16 over 3.35 TB/s + 2 ms; 57,344 KV bytes/token.
    assert p7.base_s == pytest.approx(7.6156e9 * 2 / 3.35e12 + 2e-3, rel=1e-4)
    assert p7.kv_s_per_token == pytest.approx(57344 / 3.35e12)
    assert p7.roofline_batch == 295
    assert p7.kv_capacity_tokens == pytest.approx((72e9 - 7.6156e9 * 2) / 57344, rel=1e-4)
    p32 = PROFILES["h800-32b-tp4"].timing
    assert p32.kv_s_per_token == pytest.approx(262144 / 4 / 3.35e12)
    assert p32.kv_capacity_tokens == pytest.approx((4 * 72e9 - 32.764e9 * 2) / 262144, rel=1e-4)


@pytest.fixture
def model_dir(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "eos_token_id": [EOS, 9]}))
    (model / "model.safetensors").write_bytes(b"")
    return model


def spec(model_dir: Path, engine_table: dict) -> dict:
    return {"job": {"name": "t"}, "model": {"path": str(model_dir)},
            "task": {"env": {"kind": "arithmetic"}}, "rollout": {"engine": engine_table}}


def errors(model_dir: Path, engine_table: dict) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_spec(spec(model_dir, engine_table), base_dir=model_dir.parent)
    return info.value.errors


@pytest.mark.parametrize(("table", "expected"), [
    ({"profile": "a100-7b"}, "rollout.engine.profile: unknown profile 'a100-7b' (known: 'h800-7b', 'h800-32b-tp4', 'h20-7b')"),
    ({"time_scale": 0}, "rollout.engine.time_scale: must be > 0, got 0"),
    ({"base_s": -1.0}, "rollout.engine.base_s: must be > 0, got -1.0"),
    ({"kv_capacity_tokens": 0}, "rollout.engine.kv_capacity_tokens: must be > 0, got 0"),
    ({"max_batch": 5000}, "rollout.engine.max_batch: must be <= 4096, got 5000"),
    ({"lengths": {"median": 0}}, "rollout.engine.lengths.median: must be > 0, got 0"),
    ({"lengths": {"median": 2000, "p99": 100}}, "rollout.engine.lengths.p99: must be >= median (2000), got 100"),
    ({"lengths": {"group_correlation": 1.5}}, "rollout.engine.lengths.group_correlation: must be <= 1, got 1.5"),
    ({"lengths": {"group_correlation": -0.1}}, "rollout.engine.lengths.group_correlation: must be >= 0, got -0.1"),
    ({"lengths": {"medain": 5}}, "rollout.engine.lengths.medain: unknown key (did you mean 'median'?)"),
    ({"lengths": {"kind": "zipf"}}, "rollout.engine.lengths.kind: unknown kind 'zipf' (registered: 'lognormal', 'trace')"),
    ({"lengths": {"kind": "trace"}}, "rollout.engine.lengths.path: required key missing"),
])
def test_bad_sim_tables_name_the_key(model_dir, table, expected):
    assert errors(model_dir, {"kind": "sim", **table}) == [f"<spec>: {expected}"]


def test_bad_traces_name_the_key(model_dir, tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "bad.jsonl").write_text('{"lengths": [3]}\n{"lengths": [0]}\n')
    for name, message in (("missing.jsonl", "cannot read {p}: No such file or directory"),
                          ("empty.jsonl", "{p} holds no lengths"),
                          ("bad.jsonl", '{p} line 2: expected {{"lengths": [positive integers]}} or '
                                        '{{"length": a positive integer}}, got {{"lengths": [0]}}')):
        got = errors(model_dir, {"kind": "sim", "lengths": {"kind": "trace", "path": name}})
        assert got == ["<spec>: rollout.engine.lengths.path: " + message.format(p=tmp_path / name)]


def test_a_model_without_vocab_size_is_refused(model_dir):
    (model_dir / "config.json").write_text("{}")
    assert errors(model_dir, {"kind": "sim"}) == [
        f"<spec>: rollout.engine.kind: the sim engine takes vocab_size (>= 2) and eos_token_id "
        f"(< vocab_size) from {model_dir}/config.json, which lacks them"]


def test_a_sim_spec_builds_through_the_registry(model_dir, tmp_path):
    (tmp_path / "trace.jsonl").write_text('{"lengths": [6, 6]}\n')
    (tmp_path / "job.toml").write_text(f"""
[job]
name = "t"
[model]
path = "{model_dir.name}"
[task.env]
kind = "arithmetic"
[rollout.engine]
kind = "sim"
profile = "h800-32b-tp4"
time_scale = 0.5
seed = 9
base_s = 0.125
[rollout.engine.lengths]
kind = "trace"
path = "trace.jsonl"
""")
    config = load_spec(tmp_path / "job.toml").rollout.engine
    assert isinstance(config, SimEngineConfig) and config.lengths.path == tmp_path / "trace.jsonl"
    t = config.timing()
    assert t.base_s == 0.125 and t.kv_s_per_token == PROFILES["h800-32b-tp4"].timing.kv_s_per_token
    clock = Clock()
    e = ROLLOUT_ENGINES.build(config, model_path=model_dir, dtype="bfloat16", clock=clock)
    assert (e.vocab_size, e.eos, e.seed, e.time_scale) == (VOCAB, EOS, 9, 0.5)
    e.add(req("a"))
    (_, r), = run_to_end(e, clock).values()
    assert len(r.token_ids) == 6 and r.token_ids.tolist()[-1] == EOS
    default = parse_spec(spec(model_dir, {"kind": "sim"})).rollout.engine
    assert (default.profile, default.lengths.kind, default.time_scale) == ("h800-7b", "lognormal", 1.0)
