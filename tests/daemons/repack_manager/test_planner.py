"""The repack planner (Laminar Algorithm 1) and the stats checks before it, in process.

Hand-worked examples first (each comment is the run of the algorithm by hand), then
hypothesis properties against the plan's invariants and against a literal transcription
of Algorithm 1 that re-sums the plan every time, as the paper writes it.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.common.spec.seams import REPACK_PLANNERS
from rlfleet.common.wire.messages import RolloutStats
from rlfleet.daemons.repack_manager.planners import (
    LaminarConfig,
    LaminarKind,
    LaminarPlanner,
    Move,
    NoPlanner,
    RepackDecision,
)
from rlfleet.daemons.repack_manager.rollout_view import (
    REJECTION_CODES,
    Rejection,
    RolloutLoad,
    check_reply,
    check_stats,
    engine_batch_limit,
)


def load(rid: str, c: float, n: int, version: int = 1, b: int | None = None) -> RolloutLoad:
    return RolloutLoad(rid, version, c, n, b)


def falling(*loads: RolloutLoad, by: float = 0.05) -> tuple[dict[str, RolloutLoad], dict[str, RolloutLoad]]:
    """(loads, previous) where every rollout's KV usage fell by ``by`` since last round."""
    now = {r.id: r for r in loads}
    return now, {r.id: RolloutLoad(r.id, r.version, r.c_used + by, r.n_reqs + 1, r.batch_limit) for r in loads}


# ---- hand-worked examples --------------------------------------------------------

def test_best_fit_picks_the_densest_destination_that_fits():
    # sorted: a .1, b .2, c .5, d .7.  a: b->.3, c->.6, d->.8 all fit; densest d.
    # b: d would reach 1.0 > .99; c -> .7.  c and d are destinations now: never sources.
    loads, prev = falling(load("a", 0.1, 1), load("b", 0.2, 2), load("c", 0.5, 3), load("d", 0.7, 4))
    plan = LaminarPlanner(c_max=0.99, roofline_batch=10).plan(loads, prev)
    assert plan.moves == (Move("a", "d"), Move("b", "c"))
    assert plan.candidates == ("a", "b", "c", "d")
    assert len(plan) == 2


def test_canfit_counts_what_the_plan_already_sends_to_a_destination():
    # sorted: a .1, b .15, f .3, d .45, c .5.
    # a -> c (densest, .6); b -> c (.75 beats d .45); f: c would be .75+.3 = 1.05 > .99
    # although c alone (.5) had room, so f -> d (.75). d and c are destinations: skipped.
    loads, prev = falling(load("a", 0.1, 1), load("b", 0.15, 1), load("f", 0.3, 1),
                          load("d", 0.45, 1), load("c", 0.5, 1))
    plan = LaminarPlanner(0.99, 100).plan(loads, prev)
    assert plan.moves == (Move("a", "c"), Move("b", "c"), Move("f", "d"))


def test_the_batch_limit_binds():
    # B = 5. a (n 2) cannot go to d (n 4 + 2 = 6 > 5) although d is densest: a -> c (n 5).
    # b: d 4+2 > 5, c 5+2 > 5: stays. d: b would fit in KV (.9) but not in B (2+4 = 6).
    loads, prev = falling(load("a", 0.1, 2), load("b", 0.2, 2), load("c", 0.5, 3), load("d", 0.7, 4))
    plan = LaminarPlanner(0.99, 5).plan(loads, prev)
    assert plan.moves == (Move("a", "c"),)


def test_the_kv_threshold_binds():
    # C_max .9: a .3 -> c (.3 + .6 = .9 <= .9), not b (.95); then b: c at .9 is full.
    loads, prev = falling(load("a", 0.3, 1), load("b", 0.65, 1), load("c", 0.6, 1))
    plan = LaminarPlanner(0.9, 10).plan(loads, prev)
    assert plan.moves == (Move("a", "c"),)


def test_versions_are_packed_apart():
    loads, prev = falling(load("a", 0.1, 1, version=1), load("b", 0.5, 1, version=1),
                          load("c", 0.2, 1, version=2), load("d", 0.6, 1, version=2),
                          load("e", 0.3, 1, version=3))  # alone in its version: nowhere to go
    plan = LaminarPlanner(0.99, 10).plan(loads, prev)
    assert plan.moves == (Move("a", "b"), Move("c", "d"))  # never a -> d, the densest overall
    assert plan.candidates == ("a", "b", "c", "d", "e")


def test_only_rollouts_in_ramp_down_are_candidates():
    planner = LaminarPlanner(0.9, 8)
    loads = {r.id: r for r in [
        load("down", 0.2, 2), load("dest", 0.5, 2),
        load("up", 0.3, 2),  # KV grew since last round: ramping up
        load("flat", 0.4, 2),  # unchanged: Algorithm 1 wants C_used < C_prev, strictly
        load("new", 0.1, 2),  # no previous round: no evidence of ramp-down
        load("reloaded", 0.1, 2, version=2),  # previous was on version 1: just loaded new weights
        load("full", 0.95, 2),  # above C_max: still saturated
        load("crowded", 0.3, 8),  # N_reqs = B: not under the roofline batch
        load("empty", 0.0, 0),  # nothing to move; pulls the newest weights by itself
    ]}
    prev = {"down": load("down", 0.3, 3), "dest": load("dest", 0.6, 3), "up": load("up", 0.2, 2),
            "flat": load("flat", 0.4, 2), "reloaded": load("reloaded", 0.8, 9, version=1),
            "full": load("full", 0.99, 3), "crowded": load("crowded", 0.4, 9), "empty": load("empty", 0.1, 1)}
    plan = planner.plan(loads, prev)
    assert plan.candidates == ("down", "dest")
    assert plan.moves == (Move("down", "dest"),)


def test_empty_inputs_plan_nothing():
    planner = LaminarPlanner()
    assert planner.plan({}, {}).moves == ()
    assert planner.plan({}).candidates == ()
    one = {"a": load("a", 0.2, 1, b=4)}
    assert planner.plan(one, {"a": load("a", 0.3, 1, b=4)}).moves == ()  # a lone candidate
    assert planner.plan(one).candidates == ()  # no previous round at all


def test_per_rollout_batch_limits_from_the_engine_profile():
    # No roofline_batch: each rollout's own B. The destination's B bounds it: x (n 3)
    # fits big (n 5 + 3 <= 8) but not small (n 2 + 3 > 4), although small is denser.
    # A rollout without a B is left out.
    loads, prev = falling(load("x", 0.1, 3, b=8), load("big", 0.3, 5, b=8), load("small", 0.5, 2, b=4),
                          load("nob", 0.2, 1, b=None))
    plan = LaminarPlanner(0.99, None).plan(loads, prev)
    assert plan.candidates == ("x", "big", "small")
    assert plan.moves == (Move("x", "big"),)
    # a spec-wide B overrides the profile's
    # (x -> small, the densest; nob -> small again, now at .6)
    assert LaminarPlanner(0.99, 16).plan(loads, prev).moves == (Move("x", "small"), Move("nob", "small"))


def test_ties_go_to_the_larger_id_deterministically():
    # s .1 -> p or q, both .6: q, the larger id; then p would take q to 1.3
    loads, prev = falling(load("s", 0.1, 1), load("p", 0.6, 1), load("q", 0.6, 1))
    assert LaminarPlanner(0.99, 10).plan(loads, prev).moves == (Move("s", "q"),)


def test_plan_ids_are_a_digest_of_the_inputs():
    planner = LaminarPlanner(0.99, 10)
    loads, prev = falling(load("a", 0.1, 1), load("b", 0.5, 1))
    first = planner.plan(loads, prev)
    assert first.id.startswith("plan-")
    assert planner.plan(dict(reversed(loads.items())), dict(prev)).id == first.id  # order-free
    changed = dict(loads, b=load("b", 0.51, 1))
    assert planner.plan(changed, prev).id != first.id
    assert LaminarPlanner(0.95, 10).plan(loads, prev).id != first.id
    assert planner.plan(loads, {}).id != first.id


def test_the_none_kind_still_plans_nothing_and_stays_the_default():
    planner = REPACK_PLANNERS.build(REPACK_PLANNERS.default_config())
    assert isinstance(planner, NoPlanner)
    loads, prev = falling(load("a", 0.1, 1), load("b", 0.5, 1))
    assert planner.plan(loads, prev) == RepackDecision("none") and not planner.plan(loads, prev)


def test_the_laminar_kind_builds_from_its_table():
    config = LaminarConfig(c_max=0.9, roofline_batch=64, interval_s=2.5)
    planner = REPACK_PLANNERS.build(config)
    assert isinstance(planner, LaminarPlanner)
    assert (planner.c_max, planner.roofline_batch) == (0.9, 64)
    assert LaminarConfig().model_dump() == {"kind": "laminar", "c_max": 0.99, "roofline_batch": None,
                                            "interval_s": 5.0}


def test_laminar_needs_a_batch_limit_from_somewhere():
    class Engine:  # an engine kind with neither roofline_batch nor max_batch
        kind = "sglang"

    class Rollout:
        engine = Engine()

    assert LaminarKind.check(LaminarConfig(), {"rollout": Rollout()}) == [
        (("roofline_batch",), "required: the 'sglang' rollout engine has no roofline_batch or max_batch to take B from")]
    assert LaminarKind.check(LaminarConfig(roofline_batch=32), {"rollout": Rollout()}) == []
    Engine.max_batch = 32
    assert engine_batch_limit(Engine()) == 32
    assert LaminarKind.check(LaminarConfig(), {"rollout": Rollout()}) == []


# ---- the stats checks ------------------------------------------------------------

LIVE = {"r1", "r2"}


def stats(rid: str = "r1", version: int = 3, running: int = 4, waiting: int = 2, kv_used: int = 300,
          kv_total: int = 1000, tokens_per_s: float = 120.0, time: float = 1.7e9) -> RolloutStats:
    return RolloutStats(version, running, waiting, kv_used, kv_total, tokens_per_s, rollout_id=rid, time=time)


def test_a_sound_reply_becomes_a_load():
    assert check_reply("r1", stats(), LIVE, batch_limit=64) == RolloutLoad("r1", 3, 0.3, 6, 64)
    assert check_reply("r1", stats(kv_used=1000), LIVE).c_used == 1.0  # full is possible


@pytest.mark.parametrize(("asked", "reply", "code", "reason"), [
    ("r9", stats("r9"), "unknown_rollout", "not a live rollout member"),
    ("r1", stats("r2"), "wrong_rollout", "the reply names rollout 'r2'"),
    ("r1", stats(kv_used=1200), "kv_over_capacity", "kv_used 1200 > kv_total 1000 (C_used 1.2 > 1)"),
    ("r1", stats(kv_total=0, kv_used=0), "kv_total", "kv_total must be > 0, got 0"),
    ("r1", stats(kv_total=-5, kv_used=0), "kv_total", "kv_total must be > 0, got -5"),
    ("r1", stats(running=-1), "negative", "running must be >= 0, got -1"),
    ("r1", stats(waiting=-3), "negative", "waiting must be >= 0, got -3"),
    ("r1", stats(kv_used=-1), "negative", "kv_used must be >= 0, got -1"),
    ("r1", stats(version=-1), "negative", "weight_version must be >= 0, got -1"),
    ("r1", stats(tokens_per_s=-2.0), "negative", "tokens_per_s must be >= 0, got -2.0"),
    ("r1", stats(tokens_per_s=math.nan), "non_finite", "tokens_per_s must be finite, got nan"),
    ("r1", stats(time=math.inf), "non_finite", "time must be finite, got inf"),
    ("r1", stats(running=True), "type", "running must be an integer, got True"),
    ("r1", stats(kv_used=0.5), "type", "kv_used must be an integer, got 0.5"),
    ("r1", stats(tokens_per_s="fast"), "type", "tokens_per_s must be a number, got 'fast'"),
])
def test_impossible_replies_are_rejected_with_the_reason(asked, reply, code, reason):
    rejection = check_reply(asked, reply, LIVE)
    assert rejection == Rejection(asked, code, reason)
    assert code in REJECTION_CODES
    assert str(rejection) == f"rollout {asked!r}: {reason}"


def test_a_bad_batch_limit_is_rejected():
    assert check_reply("r1", stats(), LIVE, batch_limit=0) == Rejection(
        "r1", "batch_limit", "batch_limit must be a positive integer, got 0")


def test_check_stats_splits_a_poll_and_only_accepted_loads_reach_the_planner():
    replies = {"r1": stats("r1", kv_used=100), "r2": stats("r2", kv_used=2000), "r3": stats("r3")}
    loads, rejections = check_stats(replies, ["r1", "r2"], batch_limits={"r1": 8})
    assert loads == {"r1": RolloutLoad("r1", 3, 0.1, 6, 8)}
    assert [(r.rollout_id, r.code) for r in rejections] == [("r2", "kv_over_capacity"), ("r3", "unknown_rollout")]
    # a round later r1 fell, r2 is sane: r1 (.05) moves to r2 (.5)
    replies = {"r1": stats("r1", running=2, waiting=0, kv_used=50),
               "r2": stats("r2", running=2, waiting=0, kv_used=500)}
    prev = {"r1": loads["r1"], "r2": RolloutLoad("r2", 3, 0.6, 7, 8)}
    now, rejections = check_stats(replies, LIVE, batch_limits={"r1": 8, "r2": 8})
    assert rejections == []
    assert LaminarPlanner().plan(now, prev).moves == (Move("r1", "r2"),)


ints = st.integers(min_value=-3, max_value=2000)


@given(ints, ints, ints, ints, ints, st.floats(allow_nan=True, allow_infinity=True))
def test_property_a_reply_is_accepted_exactly_when_possible(version, running, waiting, kv_used, kv_total, tps):
    reply = stats("r1", version, running, waiting, kv_used, kv_total, tps)
    possible = (min(version, running, waiting, kv_used) >= 0 and kv_total > 0 and kv_used <= kv_total
                and math.isfinite(tps) and tps >= 0)
    checked = check_reply("r1", reply, LIVE)
    if possible:
        assert isinstance(checked, RolloutLoad)
        assert 0.0 <= checked.c_used <= 1.0 and checked.n_reqs == running + waiting
    else:
        assert isinstance(checked, Rejection) and checked.code in REJECTION_CODES


# ---- properties of Algorithm 1 ---------------------------------------------------

def reference_plan(planner: LaminarPlanner, loads: dict[str, RolloutLoad],
                   previous: dict[str, RolloutLoad]) -> list[Move]:
    """Algorithm 1 as printed (re-summing P for every CanFit and argmax), with this
    planner's candidate rule and its one stated deviation (a destination is no source)."""
    moves: list[Move] = []
    for version in sorted({r.version for r in loads.values()}):
        S = sorted((r for r in loads.values() if r.version == version
                    and planner.is_candidate(r, previous.get(r.id))), key=lambda r: (r.c_used, r.id))
        P: list[tuple[RolloutLoad, RolloutLoad]] = []
        E: set[str] = set()

        def c_load(d: RolloutLoad) -> float:
            total = d.c_used
            for s2, d2 in P:
                if d2.id == d.id:
                    total += s2.c_used
            return total

        def n_load(d: RolloutLoad) -> int:
            return d.n_reqs + sum(s2.n_reqs for s2, d2 in P if d2.id == d.id)

        def can_fit(d: RolloutLoad, s: RolloutLoad) -> bool:
            return c_load(d) + s.c_used <= planner.c_max and n_load(d) + s.n_reqs <= planner.batch_limit(d)

        for s in S:
            if s.id in E or any(d2.id == s.id for _, d2 in P):
                continue
            D = [d for d in S if d.id not in E and d.id != s.id and can_fit(d, s)]
            if D:
                best = max(D, key=lambda d: (c_load(d), d.id))
                P.append((s, best))
                E.add(s.id)
        moves.extend(Move(s.id, d.id) for s, d in P)
    return moves


@st.composite
def fleets(draw):
    """A fleet of up to 40 rollouts over up to 3 versions, KV as slots of a 1000-slot
    cache, most in ramp-down; B either spec-wide or per rollout."""
    size = draw(st.integers(0, 40))
    spec_b = draw(st.one_of(st.none(), st.integers(1, 24)))
    c_max = draw(st.sampled_from([0.5, 0.8, 0.9, 0.99, 1.0]))
    loads, prev = {}, {}
    for i in range(size):
        rid = f"r{i:02d}"
        version = draw(st.integers(0, 2))
        used = draw(st.integers(0, draw(st.sampled_from([300, 1000]))))  # ramp-down: mostly low
        n = draw(st.integers(0, draw(st.sampled_from([8, 30]))))
        b = None if spec_b is not None or draw(st.integers(0, 5)) == 0 else draw(st.integers(1, 32))
        loads[rid] = RolloutLoad(rid, version, used / 1000, n, b)
        shape = draw(st.sampled_from(["down", "down", "down", "up", "none", "other_version"]))
        if shape == "down":
            prev[rid] = RolloutLoad(rid, version, min(1.0, (used + draw(st.integers(0, 200))) / 1000), n, b)
        elif shape == "up":
            prev[rid] = RolloutLoad(rid, version, max(0, used - draw(st.integers(0, 200))) / 1000, n, b)
        elif shape == "other_version":
            prev[rid] = RolloutLoad(rid, version + 1, 1.0, n, b)
    return LaminarPlanner(c_max, spec_b), loads, prev


@settings(max_examples=300, deadline=None)
@given(fleets())
def test_property_plans_respect_the_limits_and_match_algorithm_1(fleet):
    planner, loads, prev = fleet
    plan = planner.plan(loads, prev)
    sources = [m.source for m in plan.moves]
    destinations = {m.destination for m in plan.moves}
    candidates = set(plan.candidates)

    # all candidates considered: S is exactly the rollouts the rule admits
    assert candidates == {rid for rid, r in loads.items() if planner.is_candidate(r, prev.get(rid))}
    assert len(plan.candidates) == len(candidates)
    # a rollout is moved at most once, and never both a source and a destination
    assert len(sources) == len(set(sources))
    assert not set(sources) & destinations
    for m in plan.moves:
        s, d = loads[m.source], loads[m.destination]
        assert {m.source, m.destination} <= candidates
        assert s.version == d.version
    # every destination ends within C_max and B
    final_c = {d: loads[d].c_used for d in destinations}
    final_n = {d: loads[d].n_reqs for d in destinations}
    for m in plan.moves:
        final_c[m.destination] += loads[m.source].c_used
        final_n[m.destination] += loads[m.source].n_reqs
    for d in destinations:
        assert math.fsum([loads[d].c_used] + [loads[m.source].c_used for m in plan.moves
                                              if m.destination == d]) <= planner.c_max + 1e-9
        assert final_n[d] <= planner.batch_limit(loads[d])
    # a candidate left alone had nowhere to go, even at the end of the plan
    for rid in candidates - set(sources) - destinations:
        s = loads[rid]
        for d in candidates - set(sources) - {rid}:
            dl = loads[d]
            if dl.version != s.version:
                continue
            fits = (final_c.get(d, dl.c_used) + s.c_used <= planner.c_max
                    and final_n.get(d, dl.n_reqs) + s.n_reqs <= planner.batch_limit(dl))
            assert not fits, (rid, d)
    # and the fast best-fit takes exactly the decisions of the literal algorithm
    assert list(plan.moves) == reference_plan(planner, loads, prev)


def test_the_plan_time_bench_runs_and_writes_its_record(tmp_path, capsys):
    from rlfleet.tools.bench.repack_plan import main

    out = tmp_path / "plan.json"
    assert main(["--rollouts", "60", "--plans", "5", "--warmup", "1", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["rollouts"] == 60 and len(record["plan_ms"]) == 5
    assert 0 < record["plan_ms_p50"] <= record["plan_ms_p99"] <= record["plan_ms_max"]
    assert record["candidates_mean"] > 0 and record["met"] is True
    assert json.loads(capsys.readouterr().out.strip())["plan_ms_p50"] == record["plan_ms_p50"]
