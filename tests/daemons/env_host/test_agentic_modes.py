"""Env modes and redundant rollouts on the env-host's data path in process: real etcd
claims, a fake rollout and a fake reward-host on real sockets, the journal on disk, and
the sim task with simulated environment latency and failures (docs/guide/agentic.md)."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.daemons.env_host.claims import parse_cursor
from rlfleet.daemons.env_host.env_modes import BatchBarrier
from rlfleet.daemons.env_host.groups import PromptGroup, Round
from rlfleet.daemons.env_host.journal import TrajectoryJournal
from rlfleet.daemons.env_host.manager import ManagerConfig
from rlfleet.daemons.tasks import get_task
from rlfleet.daemons.tasks.prompts import parse_trajectory_id, trajectory_id
from tests.integration.helpers import wait_for

from .fakes import FakeRollout, answer
from .test_runner import KEYS, FakeRewardHost
from .test_runner import Host as RunnerHost

G = 4


# -- the policies, pure -------------------------------------------------------------------
def test_a_group_hands_on_its_first_good_trajectories_and_spares_the_rest():
    g = PromptGroup(group_size=4, launched=6, running=6)
    assert [g.finished(ok=True) for _ in range(3)] == ["hand_on"] * 3
    assert g.finished(ok=False) == "spare"  # two still running can make the group whole
    assert g.finished(ok=True) == "hand_on" and g.complete
    assert g.cancel_now()  # the last one is not needed
    assert g.finished(ok=True) == "spare"


def test_failures_are_handed_on_once_the_group_can_no_longer_be_whole():
    g = PromptGroup(group_size=4, launched=5, running=5)
    assert g.finished(ok=False) == "spare"  # 4 running can still make it
    assert g.finished(ok=False) == "hand_on"  # 3 running: it cannot; the trainer drops the group
    assert [g.finished(ok=True) for _ in range(3)] == ["hand_on"] * 3
    assert (g.handed, g.good, g.complete) == (4, 3, False)


def test_without_spares_every_trajectory_is_handed_on_as_before():
    g = PromptGroup(group_size=4, launched=4, running=4)
    assert [g.finished(ok=k != 1) for k in range(4)] == ["hand_on"] * 4


def test_an_abandoned_group_hands_on_what_is_cancelled_until_it_is_whole():
    g = PromptGroup(group_size=4, launched=6, running=6)
    g.finished(ok=True)
    g.abandoned = True
    assert g.cancel_now()
    assert [g.finished(ok=False) for _ in range(5)] == ["hand_on"] * 3 + ["spare"] * 2


def test_a_round_has_enough_when_its_needed_groups_are_complete():
    rnd = Round([0, 1, 2], needed=2)
    assert not rnd.group_complete(0)
    assert not rnd.group_complete(0)  # counted once
    assert rnd.group_complete(2)


def test_the_batch_barrier_holds_a_batch_until_every_running_member_has_stepped():
    async def main() -> list[tuple[str, int, float]]:
        barrier = BatchBarrier(lambda tid: int(tid[1]))  # "b0-x": batch 0
        barrier.join(["b0-a", "b0-b", "b0-c", "b1-a"])
        log: list[tuple[str, int, float]] = []

        async def member(tid: str, delays: list[float]) -> None:
            for turn, d in enumerate(delays):
                await asyncio.sleep(d)
                await barrier.after_step(tid, turn)
                log.append((tid, turn, time.monotonic()))
            barrier.leave(tid)

        await asyncio.gather(member("b0-a", [0.01, 0.01]), member("b0-b", [0.2, 0.01]),
                             member("b0-c", [0.05]), member("b1-a", [0.01, 0.01]))
        return log

    t0 = time.monotonic()
    log = asyncio.run(main())
    released = {(tid, turn): t - t0 for tid, turn, t in log}
    # batch 0's first turn waits for its slowest member (0.2 s); batch 1 does not
    assert min(released[("b0-a", 0)], released[("b0-c", 0)]) >= 0.19
    assert released[("b1-a", 0)] < 0.1
    # c left after one turn: a and b's second barrier does not wait for it
    assert released[("b0-a", 1)] < 0.35


# -- the runner, with sockets and etcd -----------------------------------------------------
def Host(store, rollout, reward_host, path, *, task, prompts_per_batch=2, max_concurrent=64, **options):
    """test_runner's env-host incarnation, with the sim task and the agentic options."""
    return RunnerHost(store, rollout, reward_host, path, group_size=G, max_concurrent=max_concurrent, task=task,
                      config=ManagerConfig(turn_timeout_s=5.0, trajectory_timeout_s=20.0, max_retries=1,
                                           prompts_per_batch=prompts_per_batch), **options)


@pytest.fixture
def world(etcd, tmp_path):
    store = EtcdStore(etcd.endpoints)
    rollout = FakeRollout(answer("1"))
    reward_host = FakeRewardHost()
    yield store, rollout, reward_host, tmp_path / "env-0.jsonl"
    reward_host.close()
    rollout.close()
    store.close()


def _by_prompt(delivered: dict) -> dict[int, list]:
    out: dict[int, list] = {}
    for tid, t in delivered.items():
        out.setdefault(parse_trajectory_id(tid)[0], []).append(t)
    return out


def _forgotten(store, path, launched: int) -> tuple[int, set[int]]:
    nxt, _ = parse_cursor(store.get(KEYS.prompts_cursor).value)
    return nxt, set(range(nxt)) - set(TrajectoryJournal(path, launched).live_prompts())


def test_redundant_samples_hand_on_whole_groups_and_keep_the_spares(world):
    store, rollout, reward_host, path = world
    task = get_task("sim", step_latency_mean_s=0.05, step_latency_std_s=0.05, failure_rate=0.15)
    host = Host(store, rollout, reward_host, path, task=task, redundant_samples=2)
    try:
        wait_for("40 prompts handed on", lambda: len(_by_prompt(reward_host.unique())) >= 40, 60)
        wait_for("spares kept", lambda: sum(host.runner.spares.values()) >= 20, 60)
    finally:
        host.stop()
    spares = dict(host.runner.spares)
    nxt, done = _forgotten(store, path, G + 2)
    groups = _by_prompt(reward_host.unique())
    assert done and done <= set(groups), "a forgotten prompt was never handed on"
    for p in done:  # every finished prompt handed on exactly one group of G, spares kept here
        assert len(groups[p]) == G, (p, [t.trajectory_id for t in groups[p]])
    assert max(len(g) for g in groups.values()) <= G
    # failures were absorbed by spares: far fewer groups carry a dropped trajectory than
    # without redundancy (1 - 0.85^4 = 48% of groups would)
    failed_groups = sum(1 for p in done if any(t.dropped_reason for t in groups[p]))
    assert failed_groups <= 0.2 * len(done), (failed_groups, len(done))
    assert set(spares) <= {"redundant", "env_error"} and spares.get("redundant", 0) > 0, spares


def test_batch_mode_steps_a_round_together_turn_by_turn(world):
    store, rollout, reward_host, path = world
    task = get_task("sim", max_turns=3, step_latency_mean_s=0.02, step_latency_std_s=0.1)
    seen: list[tuple[float, str]] = []
    inner = rollout.behaviour

    def record(srv, req):
        seen.append((time.monotonic(), req.request_id))
        return inner(srv, req)

    rollout.behaviour = record
    host = Host(store, rollout, reward_host, path, task=task, env_mode="batch", prompts_per_batch=2,
                max_concurrent=2 * G)
    try:
        wait_for("3 rounds handed on", lambda: len(_by_prompt(reward_host.unique())) >= 6, 60)
    finally:
        host.stop()
    assert host.runner.gate.rounds >= 6  # two barriers per 3-turn round
    # Within a round (prompts 2r, 2r+1), no trajectory asks for turn k+1 before every one
    # asked for turn k: the barrier sits between them.
    first_ask: dict[tuple[int, int], list[float]] = {}
    for t, rid in seen:
        tid, turn = rid.split("-t")[0], int(rid.split("-t")[1].split("-")[0])
        first_ask.setdefault((parse_trajectory_id(tid)[0] // 2, turn), []).append(t)
    for (rnd, turn), times in first_ask.items():
        later = first_ask.get((rnd, turn + 1))
        if later and len(times) == 2 * G:
            assert min(later) >= max(times), (rnd, turn)


def test_redundant_prompts_close_a_round_and_drop_the_rest_as_redundant(world):
    store, rollout, reward_host, path = world
    task = get_task("sim", step_latency_mean_s=0.02, step_latency_std_s=0.3)
    host = Host(store, rollout, reward_host, path, task=task, env_mode="batch", prompts_per_batch=2,
                redundant_prompts=2, max_concurrent=4 * G)
    try:
        wait_for("5 rounds handed on", lambda: len(_by_prompt(reward_host.unique())) >= 20, 90)
    finally:
        host.stop()
    nxt, done = _forgotten(store, path, G)
    groups = _by_prompt(reward_host.unique())
    rounds: dict[int, list[int]] = {}
    for p in done:
        rounds.setdefault(p // 4, []).append(p)
    whole = [r for r, ps in rounds.items() if len(ps) == 4]
    assert len(whole) >= 4
    closed_early = 0
    for r in whole:
        complete = [p for p in rounds[r] if len(groups[p]) == G and not any(t.dropped_reason for t in groups[p])]
        redundant = [p for p in rounds[r] if any(t.dropped_reason == "redundant" for t in groups[p])]
        assert len(complete) >= 2, (r, complete)  # a batch's worth of whole groups
        assert set(complete) | set(redundant) == set(rounds[r]), (r, complete, redundant)
        for p in rounds[r]:  # every prompt handed on all G (the redundant ones as dropped)
            assert sorted(t.trajectory_id for t in groups[p]) == [trajectory_id(p, k) for k in range(G)]
        closed_early += bool(redundant)
    # A step latency of 0.02 +- 0.3 s spreads a round's prompts far apart: it closes on its
    # first two whole groups nearly always, not only when its last ones finish at once
    # (1 or 2 rounds of 4 when the round forgot groups whose trajectories were acked).
    assert closed_early >= 3 * len(whole) // 4, (closed_early, len(whole))


def test_spares_survive_a_restart_of_the_env_host(world):
    store, rollout, reward_host, path = world
    task = get_task("sim", step_latency_mean_s=0.05, step_latency_std_s=0.1, failure_rate=0.1)
    host = Host(store, rollout, reward_host, path, task=task, redundant_samples=2)
    try:
        wait_for("spares kept", lambda: sum(host.runner.spares.values()) >= 8, 60)
    finally:
        host.stop()  # mid-flight: partial prompts stay in the journal
    host = Host(store, rollout, reward_host, path, task=task, redundant_samples=2)
    try:
        first_next, _ = parse_cursor(store.get(KEYS.prompts_cursor).value)
        wait_for("the prompts of the first incarnation handed on, a group each",
                 lambda: all(len(_by_prompt(reward_host.unique()).get(p, [])) == G for p in range(first_next)), 60)
    finally:
        host.stop()
    groups = _by_prompt(reward_host.unique())
    assert all(len(g) <= G for g in groups.values()), {p: len(g) for p, g in groups.items() if len(g) > G}
