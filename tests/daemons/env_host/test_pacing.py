"""Claim pacing on a real etcd: prompts claimed but not consumed by the trainer stay
within the limit, and more are claimed as soon as trainer/progress moves."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.records import TrainerProgress
from rlfleet.common.spec.errors import SpecError
from rlfleet.common.spec.job import parse_spec
from rlfleet.daemons.env_host import pacing
from rlfleet.daemons.env_host.claims import PromptClaimer
from rlfleet.daemons.env_host.pacing import ClaimPacer, claim_limit, consumed_of, pacer_for, round_limit
from tests.integration.helpers import TINY_MODEL, wait_for

KEYS = JobKeys("pacing")


def spec(pace_claims=True, mode="trajectory", **trainer):
    return parse_spec({"job": {"name": "pacing"}, "model": {"path": str(TINY_MODEL)},
                       "task": {"env": {"kind": "arithmetic"}, "group_size": 8},
                       "trainer": {"batch_size": 32, **trainer}, "env_host": {"pace_claims": pace_claims},
                       "rollout": {"mode": mode}})


def test_the_limit_is_max_staleness_batches_of_prompts():
    assert claim_limit(spec(max_staleness=2)) == 8   # 2 batches x 4 prompts
    assert claim_limit(spec(max_staleness=0)) == 4   # at least one batch
    assert claim_limit(spec()) is None               # unbounded staleness: no pacing
    assert claim_limit(spec(pace_claims=False, max_staleness=2)) is None
    assert [consumed_of(v) for v in ({"consumed_groups": 7}, {"consumed_groups": "7"}, None, [])] == [7, 0, 0, 0]


def test_claims_wait_for_the_trainer_and_resume_when_it_consumes(etcd):
    store = EtcdStore(etcd.endpoints)
    woken = threading.Event()
    pacer = ClaimPacer(store, KEYS, limit=4, on_progress=woken.set).start()
    claimer = PromptClaimer(store, KEYS, "env-0", budget=pacer.budget)
    try:
        assert claimer.claim(3) == range(0, 3)
        assert claimer.claim(3) == range(3, 4)      # only 1 more fits under the limit of 4
        assert claimer.claim(2) == range(4, 4)      # none: empty, and the cursor did not move
        assert store.get(KEYS.prompts_cursor).value["next"] == 4
        store.put(KEYS.trainer_progress, {"version": 1, "consumed_groups": 2})
        assert woken.wait(5), "the pacer never saw trainer/progress"
        assert claimer.claim(5) == range(4, 6)      # two consumed: two more
        # A stale or malformed value never shrinks what was consumed.
        store.put(KEYS.trainer_progress, {"version": 0, "consumed_groups": 1})
        store.put(KEYS.trainer_progress, "garbage")
        store.put(KEYS.trainer_progress, {"version": 2, "consumed_groups": 6})
        wait_for("consumed 6", lambda: pacer.consumed == 6, timeout_s=5)
        assert claimer.claim(8) == range(6, 10)
    finally:
        pacer.stop()
        store.close()


def test_a_pacer_started_late_reads_the_current_progress(etcd):
    store = EtcdStore(etcd.endpoints)
    store.put(KEYS.trainer_progress, {"version": 9, "consumed_groups": 40})
    pacer = ClaimPacer(store, KEYS, limit=8).start()
    try:
        wait_for("the current progress", lambda: pacer.consumed == 40, timeout_s=5)
        assert pacer.budget(44) == 4
        with pytest.raises(ValueError, match="limit: must be >= 1, got 0"):
            ClaimPacer(store, KEYS, limit=0)
    finally:
        pacer.stop()
        store.close()


def test_prompts_that_never_finish_are_written_off_after_a_stall(etcd):
    # An env-host gone for good keeps its prompts outstanding forever; pacing must not
    # stop the job for that.
    now = [1000.0]
    store = EtcdStore(etcd.endpoints)
    pacer = ClaimPacer(store, KEYS, limit=4, clock=lambda: now[0])
    try:
        assert pacer.budget(4) == 0                 # 4 outstanding: none now
        now[0] += pacing.STALL_S - 0.1
        assert pacer.budget(4) == 0 and pacer.written_off == 0   # not yet a stall
        now[0] += 0.2
        assert pacer.budget(4) == 4 and pacer.written_off == 4
        assert pacer.budget(6) == 2                 # counted afresh from the write-off
        pacer._set(TrainerProgress(consumed_groups=3))  # consumption pays the write-off back
        assert pacer.written_off == 1 and pacer.budget(6) == 2  # 6 - 3 - 1 outstanding
        pacer._set(TrainerProgress(consumed_groups=6))
        assert pacer.written_off == 0 and pacer.budget(6) == 4
        # The pipeline is back at the limit: it never stays wider after a stall (it did,
        # by the write-off's size, for the rest of the job: drops climbed in long runs).
        assert pacer.budget(10) == 0
    finally:
        store.close()


def test_queue_filtering_adds_its_extra_prompts_to_the_limit():
    assert claim_limit(spec(max_extra_prompts=16)) == 4 + 16                   # one batch + extra
    assert claim_limit(spec(max_extra_prompts=0)) == 4                         # the batch alone
    assert claim_limit(spec(max_staleness=2, max_extra_prompts=3)) == 8 + 3   # alpha batches + extra


def test_after_batch_claims_round_by_round(etcd):
    assert [round_limit(4, received) for received in (0, 3, 4, 7, 8)] == [4, 4, 8, 8, 12]
    store = EtcdStore(etcd.endpoints)
    assert pacer_for(spec(), store, KEYS, lambda: None) is None  # nothing paces
    pacer = pacer_for(spec(no_signal_drops_per_batch=2, filter_schedule="after_batch"), store, KEYS, lambda: None)
    try:
        assert pacer is not None and pacer.rounds and pacer.limit == 1 << 30
        assert pacer.budget(0) == 4 and pacer.budget(3) == 1 and pacer.budget(4) == 0
        pacer._set(TrainerProgress(consumed_groups=2, received_groups=3))  # 3 of the round in: wait
        assert pacer.budget(4) == 0
        pacer._set(TrainerProgress(consumed_groups=2, received_groups=4))  # the round is in: the next
        assert pacer.budget(4) == 4 and pacer.outstanding == 2
        # queue: the extra prompts, and a dropped group's replacement at once (it is consumed)
        queue = pacer_for(spec(no_signal_drops_per_batch=2, max_extra_prompts=2), store, KEYS, lambda: None)
        assert queue is not None and not queue.rounds and queue.budget(0) == 6 and queue.budget(6) == 0
        queue._set(TrainerProgress(consumed_groups=1, received_groups=1))
        assert queue.budget(6) == 1
    finally:
        store.close()


def test_a_batch_mode_rounds_redundant_prompts_are_paced_with_their_batch():
    from rlfleet.daemons.env_host.pacing import claim_limit

    def spec(**env):
        return SimpleNamespace(trainer=SimpleNamespace(max_staleness=2, max_extra_prompts=None, batch_size=32),
                               task=SimpleNamespace(group_size=8),
                               env_host=SimpleNamespace(pace_claims=True, redundant_prompts=env.get("extra", 0)))
    assert claim_limit(spec()) == 2 * 4
    assert claim_limit(spec(extra=2)) == 2 * (4 + 2)  # a whole round per batch, not cut to the batch


LAG_KEYS = JobKeys("pacing-lag")


def test_the_lag_of_the_rollouts_weights_takes_batches_off_the_limit(etcd):
    """env_host.pace_for_lag: a prompt claimed now is trained about outstanding/batch
    versions later, plus the versions its rollout's weights trail the trainer by; each
    version of lag takes one batch (4 prompts) off the limit of 8, down to one batch."""
    assert [pacing.lag_limit(8, 4, 10, seen) for seen in (10, 11, 9, 8, 0)] == [8, 8, 4, 4, 4]
    assert pacing.lag_limit(3, 4, 10, 0) == 3  # a limit under one batch is never raised
    # env_host.pace_lag_allowance: that many versions of lag are let pass
    assert [pacing.lag_limit(12, 4, 10, seen, allowance=1) for seen in (10, 9, 8, 7, 0)] == [12, 12, 8, 4, 4]
    seen = [0]
    unpaced = parse_spec({**spec(max_staleness=2).to_dict(), "env_host": {"pace_for_lag": False}})
    assert pacer_for(unpaced, None, LAG_KEYS, lambda: None, weights_seen=lambda: seen[0]).weights_seen is None
    assert spec(max_staleness=2).env_host.pace_for_lag  # on by default (docs/results/drops.md)
    allowing = parse_spec({**spec(max_staleness=2).to_dict(),
                           "env_host": {"pace_for_lag": True, "pace_lag_allowance": 1}})
    assert pacer_for(allowing, None, LAG_KEYS, lambda: None, weights_seen=lambda: seen[0]).lag_allowance == 1
    with pytest.raises(SpecError, match=r"env_host\.pace_lag_allowance.*needs pace_for_lag = true"):
        parse_spec({**spec(max_staleness=2).to_dict(), "env_host": {"pace_for_lag": False, "pace_lag_allowance": 1}})
    lagged = parse_spec({**spec(max_staleness=2).to_dict(), "env_host": {"pace_for_lag": True}})
    # (a job of its own: the module's etcd holds the other tests' trainer/progress)
    store = EtcdStore(etcd.endpoints)
    pacer = pacer_for(lagged, store, LAG_KEYS, lambda: None, weights_seen=lambda: seen[0]).start()
    try:
        store.put(LAG_KEYS.trainer_progress, {"version": 5, "consumed_groups": 20})
        wait_for("the trainer's progress", lambda: pacer.version == 5, timeout_s=5)
        assert pacer.budget(20) == 4                # the rollouts' weights: version 0, lag 5
        seen[0] = 4
        assert pacer.budget(20) == 4                # lag 1: one batch off
        seen[0] = 5
        assert pacer.budget(20) == 8 and pacer.budget(24) == 4  # no lag: the whole limit
    finally:
        pacer.stop()
        store.close()
