"""The reward service's scheduling policy in process (reward_host/stages.py, queues.py,
reward_sim.py, scaling.py): EBF and FCFS orders, the pipeline simulator with timeouts,
and the DistRS planner (Algorithms 1 and 2), on hand-computed examples."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.daemons.reward_host.pipeline.queues import EbfQueue, FcfsQueue, make_queue
from rlfleet.daemons.reward_host.pipeline.scaling import ScalingPlanner, search_workers, zero_queue_workers
from rlfleet.daemons.reward_host.pipeline.simulator import Guard, SimRequest, simulate
from rlfleet.daemons.reward_host.pipeline.stages import (
    ActiveBatch,
    BatchKey,
    BatchRecord,
    Pipeline,
    Request,
    RequestKey,
    Stage,
)

TWO = Pipeline((Stage("compile", "cpu", 1.0, 10.0), Stage("run", "accelerator", 5.0, 5.0)))
ONE = Pipeline((Stage("run", "accelerator", 1.0, 100.0),))
A, B = BatchKey("job-a", 0), BatchKey("job-b", 0)


def drain(q) -> list:
    return [q.pop() for _ in range(len(q))]


# -- queues ------------------------------------------------------------------------------------
def test_ebf_orders_by_batch_expected_completion_across_tenants_and_fcfs_inside_a_batch():
    q = EbfQueue()
    q.push("a1", 30.0)  # job-a's batch is expected at 30 s
    q.push("b1", 20.0)  # job-b's at 20 s: all of it goes first
    q.push("a2", 30.0)
    q.push("b2", 20.0)
    q.push("c1", 25.0)
    assert drain(q) == ["b1", "b2", "c1", "a1", "a2"]


def test_fcfs_ignores_the_batch_and_a_requeued_item_goes_first_in_both():
    f = FcfsQueue()
    for item, prio in (("a1", 30.0), ("b1", 20.0), ("a2", 30.0)):
        f.push(item, prio)
    assert drain(f) == ["a1", "b1", "a2"]
    e = make_queue("ebf")
    e.push("b1", 20.0)
    e.push("b2", 20.0)
    e.requeue(e.pop(), 20.0)  # handed over and failed: ahead of b2 again
    assert drain(e) == ["b1", "b2"]
    with pytest.raises(ValueError, match="'ebf' or 'fcfs'"):
        make_queue("lifo")  # type: ignore[arg-type]


# -- the stage model ----------------------------------------------------------------------------------
def test_earliest_completion_caps_each_stage_at_its_timeout_and_stops_there():
    assert TWO.run_s((2.0, 1.0)) == 3.0
    assert TWO.run_s((12.0, 1.0)) == 10.0  # compile timed out: never runs
    assert TWO.visits((12.0, 1.0)) == 1 and TWO.visits(()) == 0
    rec = BatchRecord.of(A, [Request(RequestKey("job-a", 0, "t0"), 5.0, (2.0, 1.0)),
                             Request(RequestKey("job-a", 0, "t1"), 6.0, (12.0, 1.0))], TWO)
    assert rec.offsets_s == (0.0, 1.0) and rec.service_s == ((2.0, 1.0), (10.0,))
    assert rec.earliest_done_s(TWO) == 11.0  # T = max(0 + 3, 1 + 10)
    assert TWO.costliest_first() == [1, 0]
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        Stage("x", "cpu", 1.0, 0.0)


# -- the simulator -----------------------------------------------------------------------------------
def two_batches() -> list:
    ra = [SimRequest(A, 0.0, (2.0, 1.0)), SimRequest(A, 0.0, (2.0, 1.0)), SimRequest(A, 1.0, (12.0,))]
    rb = [SimRequest(B, 0.5, (1.0, 1.0))]
    return [(A, ra, 10.0), (B, rb, 5.0)]  # B is expected first


def test_ebf_lets_the_batch_due_first_overtake_and_fcfs_does_not():
    # One worker per stage. compile: a0 0-2; then EBF takes b0 (due 5) before a1 (due 10):
    # b0 compiles 2-3, runs 3-4 -> B done at 4, T_B = 0.5 + 2 = 2.5, d = 1.5.
    ebf = simulate(TWO, [1, 1], "ebf", two_batches())
    assert ebf.done_s[B] == 4.0 and ebf.extra_delay_s()[B] == 1.5
    # a1 compiles 3-5; a2 (arrived at 1) compiles from 5 and is stopped at its 10 s timeout:
    # A done at 15 though T_A = 1 + 10 = 11; it timed out, so nobody waits past 15.
    assert ebf.done_s[A] == 15.0 and ebf.earliest_s[A] == 11.0 and ebf.failed == 1
    # FCFS: b0 waits for a1 (2-4) and compiles 4-5, runs 5-6.
    fcfs = simulate(TWO, [1, 1], "fcfs", two_batches())
    assert fcfs.done_s[B] == 6.0 and fcfs.extra_delay_s()[B] == 3.5
    assert fcfs.busy_seconds == ebf.busy_seconds == [15.0, 3.0]


def test_a_request_with_nothing_to_score_finishes_on_arrival():
    r = simulate(TWO, [1, 1], "ebf", [(A, [SimRequest(A, 3.0, ())], 3.0)])
    assert r.done_s[A] == 3.0 and r.extra_delay_s()[A] == 0.0


def test_the_guard_refuses_a_wait_that_may_run_into_the_timeouts():
    # One compile worker, deadline T + D = 3 + 1: a1 waits until 2, and may then take
    # 10 + 5 s more. History-only (not timeout-aware) sees it finish at 5: 1 s late.
    reqs = [SimRequest(A, 0.0, (2.0, 1.0)), SimRequest(A, 0.0, (2.0, 1.0))]
    aware = simulate(TWO, [1, 2], "ebf", [(A, reqs, 3.0)], Guard({A: 4.0}, timeout_aware=True))
    assert not aware.feasible and "may finish at 17.00 s" in aware.why
    blind = simulate(TWO, [1, 2], "ebf", [(A, reqs, 3.0)], Guard({A: 4.0}, timeout_aware=False))
    assert not blind.feasible and "done at 5.00 s" in blind.why
    assert simulate(TWO, [1, 2], "ebf", [(A, reqs, 3.0)], Guard({A: 5.0}, timeout_aware=False)).feasible


def test_fewer_workers_than_busy_take_effect_as_requests_finish():
    class Shrink:
        def on_batch_arrival(self, sim, batch, now):
            return [4]

        def on_batch_done(self, sim, batch, now):
            return [0]

        def long_running_after_s(self, batch, stage):
            return None

        def on_long_running(self, sim, batch, now):
            raise AssertionError("never asked: long_running_after_s is None")

    from rlfleet.daemons.reward_host.pipeline.simulator import PipelineSim
    sim = PipelineSim(ONE, [0], "fcfs")
    sim.add_batch(A, [SimRequest(A, 0.0, (2.0,)), SimRequest(A, 0.0, (4.0,))], 4.0)
    r = sim.run(Shrink())
    # 4 workers held from 0 until the batch is done at 4: 16 worker-seconds, 6 busy
    assert r.done_s[A] == 4.0 and r.worker_seconds == [16.0] and r.busy_seconds == [6.0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 50), st.floats(0.1, 30)), min_size=1, max_size=25),
       st.integers(1, 8))
def test_extra_delay_never_grows_with_more_workers_fcfs_one_stage(jobs, n):
    reqs = [SimRequest(A, t, (s,)) for t, s in jobs]
    fewer = simulate(ONE, [n], "fcfs", [(A, reqs, 0.0)]).extra_delay_s()[A]
    more = simulate(ONE, [n + 1], "fcfs", [(A, reqs, 0.0)]).extra_delay_s()[A]
    assert more <= fewer + 1e-9
    assert simulate(ONE, [len(reqs)], "fcfs", [(A, reqs, 0.0)]).extra_delay_s()[A] == pytest.approx(0.0, abs=1e-9)


# -- the planner --------------------------------------------------------------------------------------
def burst(key: BatchKey, n: int, at: float = 0.0, s: float = 4.0) -> list[SimRequest]:
    """n requests arriving together, then one straggler that is the batch's critical request."""
    return [SimRequest(key, at, (s,)) for _ in range(n)] + [SimRequest(key, at + 20.0, (s,))]


def test_the_planner_meets_its_bound_and_a_looser_bound_costs_fewer_workers():
    reqs = burst(A, 8)  # T = 24: the 8 can queue up to 20 s + D before the straggler's end
    tight, _ = search_workers(ONE, [(A, reqs, 24.0, 24.0)], max_delay_s=0.0, policy="ebf", timeout_aware=False)
    loose, _ = search_workers(ONE, [(A, reqs, 24.0, 24.0)], max_delay_s=12.0, policy="ebf", timeout_aware=False)
    # D = 0: 2 workers clear the 8 by 16 and the straggler runs 20-24. D = 12: 1 worker
    # runs the 8 until 32 and the straggler (same batch, FCFS) 32-36 = T + 12.
    for n, d in ((tight[0], 0.0), (loose[0], 12.0)):
        assert simulate(ONE, [n], "ebf", [(A, reqs, 24.0)]).extra_delay_s()[A] <= d + 1e-9
        if n > 1:
            assert simulate(ONE, [n - 1], "ebf", [(A, reqs, 24.0)]).extra_delay_s()[A] > d
    assert tight == [2] and loose == [1]


def test_timeout_awareness_keeps_room_for_late_requests():
    # the 8 arrive at 0; with timeouts of 100 s no request may wait once ts + 100 > T + D
    reqs = burst(A, 8)
    aware, _ = search_workers(ONE, [(A, reqs, 24.0, 24.0)], max_delay_s=2.0, policy="ebf", timeout_aware=True)
    blind, _ = search_workers(ONE, [(A, reqs, 24.0, 24.0)], max_delay_s=2.0, policy="ebf", timeout_aware=False)
    assert aware == [8] and blind == [2]


def test_costliest_stage_is_searched_first():
    reqs = [SimRequest(A, 0.0, (1.0, 1.0)) for _ in range(4)] + [SimRequest(A, 10.0, (1.0, 1.0))]
    counts, runs = search_workers(TWO, [(A, reqs, 12.0, 12.0)], max_delay_s=0.0, policy="ebf", timeout_aware=False)
    assert counts == [1, 1] and runs > 0  # 4 x 1 s compile then 1 s run each, all by 5 < 10


def test_zero_queue_counts_the_peak_overlap():
    rec = BatchRecord(A, (0.0, 0.5, 1.0, 5.0), ((2.0, 1.0), (2.0,), (2.0, 3.0), (1.0, 1.0)))
    # compile: [0,2] [0.5,2.5] [1,3] [5,6] -> 3; run: [2,3] [3,6] [6,7] -> 1
    assert zero_queue_workers(TWO, [rec]) == [3, 1]


def test_algorithm_2_with_two_tenants():
    planner = ScalingPlanner(ONE, max_delay_s=0.0, timeout_aware=False, policy="ebf", seed=1)
    planner.add_history(BatchRecord(BatchKey("job-a", -1), (0.0, 0.0, 0.0, 10.0), ((4.0,),) * 4))
    planner.add_history(BatchRecord(BatchKey("job-b", -1), (0.0, 30.0), ((4.0,), (4.0,))))
    assert planner.expected_done_s(A, 100.0) == 114.0 and planner.expected_done_s(B, 0.0) == 34.0
    # job-a's batch arrived at 100 and is 1 s in: three requests running (1 s of 4 done),
    # one still to come at 110 (history). job-b's arrived at 80: its second at 110.
    now = 101.0
    active = [ActiveBatch(A, 100.0, running=((0, 1.0),) * 3),
              ActiveBatch(B, 80.0, queued=(0,), done=0)]
    plan = planner.on_batch_arrival(now, active)
    # estimate: A: 3 running, 3 s left each (sampled s > 1: 4 - 1), 1 future at 110; B: 1
    # queued (4 s), 1 future at 110 (80 + 30). Both deadlines 114 (AT + T), equal EBF
    # priority. 1 worker: 3+3+3+4 s to 114, the two at 110 late. 2 workers: 101-104,
    # 104-107/108, then 110-114 for the two: on time.
    assert plan.workers == {"run": 2} and plan.simulations > 0
    # B finishes: its record joins the history; A has one request 2 s in (2 s left): 1 worker
    done = BatchRecord(B, (0.0, 30.0), ((4.0,), (4.0,)))
    after = planner.on_batch_done(112.0, done, [ActiveBatch(A, 100.0, running=((0, 2.0),))] + active[1:])
    assert after.workers == {"run": 1}
    assert planner.on_batch_done(120.0, BatchRecord(A, (0.0,), ((4.0,),)), []).workers == {"run": 0}


def test_long_running_after_is_the_longest_normal_time_of_the_tenants_history():
    planner = ScalingPlanner(TWO, max_delay_s=0.0, window=2)
    assert planner.long_running_after_s(A, 0) is None  # no history
    # compile: 2, 3 and a timeout (10, not a normal time); run: 1, and 5 is its timeout
    planner.add_history(BatchRecord(BatchKey("job-a", -2), (0.0, 0.0, 0.0), ((2.0, 1.0), (3.0, 5.0), (10.0,))))
    assert planner.long_running_after_s(A, 0) == 3.0 and planner.long_running_after_s(A, 1) == 1.0
    planner.add_history(BatchRecord(BatchKey("job-a", -1), (0.0,), ((4.0,),)))
    assert planner.long_running_after_s(A, 0) == 4.0  # the window holds both batches
    planner.add_history(BatchRecord(BatchKey("job-a", 0), (0.0,), ((1.0,),)))
    assert planner.long_running_after_s(A, 0) == 4.0 and planner.long_running_after_s(A, 1) is None  # -2 left
    assert planner.long_running_after_s(B, 0) is None  # per tenant


def test_a_long_runner_replans_and_is_then_estimated_to_its_timeout():
    # history: three requests ran 4 s, none timed out (timeout 100 s). Now two are
    # running: one 1 s in (a sample of 4: 3 s left), one 5 s in, past every normal time.
    planner = ScalingPlanner(ONE, max_delay_s=0.0, timeout_aware=True, seed=3)
    planner.add_history(BatchRecord(BatchKey("job-a", -1), (0.0, 0.0, 10.0), ((4.0,),) * 3))
    assert planner.long_running_after_s(A, 0) == 4.0
    active = [ActiveBatch(A, 0.0, running=((0, 1.0), (0, 5.0)))]
    # estimate at 5: 3 s left, to its timeout (95 s left), and the future one at 10 (4 s).
    # T = max(14, 100) = 100 and the one at 10 may not wait (10 + 100 > 100): 3 workers
    # would let it run at once, 2 do too (the 3 s one is done at 8): 2.
    assert planner.on_long_running(5.0, active).workers == {"run": 2}


def test_the_simulator_asks_for_a_plan_when_a_request_turns_long():
    asked = []

    class Watch:
        def on_batch_arrival(self, sim, batch, now):
            return [2]

        def on_batch_done(self, sim, batch, now):
            return [0]

        def long_running_after_s(self, batch, stage):
            return 3.0

        def on_long_running(self, sim, batch, now):
            asked.append((batch, now, sim.active()[0].running))
            return None

    from rlfleet.daemons.reward_host.pipeline.simulator import PipelineSim
    sim = PipelineSim(ONE, [0], "fcfs")
    sim.add_batch(A, [SimRequest(A, 0.0, (2.0,)), SimRequest(A, 1.0, (6.0,))], 7.0)
    sim.run(Watch())
    # the 2 s one never turns long; the 6 s one, started at 1, does at 4 (3 s in)
    assert asked == [(A, 4.0, ((0, 3.0),))]


@pytest.mark.parametrize("expect_late, workers", [(False, 0), (True, 2)])
def test_requests_later_than_the_history_are_expected_only_with_expect_late(expect_late, workers):
    # history: 3 requests at once, 4 s each. Now, 10 s in, only one of this batch's has
    # come (and is done): the history brings nothing more. With expect_late the other two
    # are taken to arrive now, and the plan keeps a worker for each (they are already
    # past T = 4 s, so neither may wait); without, no request is left to plan for.
    planner = ScalingPlanner(ONE, max_delay_s=1.0, timeout_aware=True, seed=1, expect_late=expect_late)
    planner.add_history(BatchRecord(BatchKey("job-a", -1), (0.0, 0.0, 0.0), ((4.0,),) * 3))
    plan = planner.on_batch_arrival(10.0, [ActiveBatch(A, 0.0, done=1)])
    assert plan.workers == {"run": workers}


def test_a_batch_ahead_of_its_history_adds_no_late_requests():
    # 3 received by 1 s where the history had 2 by then and a third at 5 s: Future still
    # brings that one, and nothing is late (received + future >= the history's 3).
    planner = ScalingPlanner(ONE, max_delay_s=0.0, timeout_aware=True, seed=1, expect_late=True)
    planner.add_history(BatchRecord(BatchKey("job-a", -1), (0.0, 0.0, 5.0), ((4.0,),) * 3))
    estimate = planner._estimate(1.0, ActiveBatch(A, 0.0, running=((0, 1.0),) * 3))
    assert sorted(r.arrival_s for r in estimate[1]) == [1.0, 1.0, 1.0, 5.0]
