"""The reward worker pool: right rewards, failures as data, hard timeouts that kill."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rlfleet.daemons.reward_host.workers import RewardJob, RewardOutcome, RewardPool
from rlfleet.daemons.tasks import get_task
from rlfleet.daemons.tasks.frozenlake import shortest_path

SCORER = "tests.daemons.reward_host.scorers:faulty"


def collect(pool: RewardPool, n: int, timeout_s: float = 20.0) -> dict[str, RewardOutcome]:
    out: dict[str, RewardOutcome] = {}
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        for o in pool.poll(0.5):
            assert o.key not in out, f"{o.key} reported twice"
            out[o.key] = o
    assert len(out) == n, f"only {len(out)} of {n} outcomes"
    return out


@pytest.fixture
def pool_factory(monkeypatch):
    # Workers import the faulty scorers from this repository, wherever pytest was started.
    repo = str(Path(__file__).resolve().parents[3])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    pools: list[RewardPool] = []

    def make(*args, **kwargs) -> RewardPool:
        pools.append(RewardPool(*args, **kwargs))
        return pools[-1]
    yield make
    for p in pools:
        p.close()


def test_rewards_match_the_tasks(pool_factory):
    arith = get_task("arithmetic")
    lake = get_task("frozenlake", max_turns=12)
    pool = pool_factory(2, 10.0)
    expected = {}
    for i, p in enumerate(arith.make_prompts("train", 20, seed=1)):
        text = p.answer if i % 3 else str(int(p.answer) + 1)
        pool.submit(RewardJob(f"a{i}", "arithmetic", {}, p, [text]))
        expected[f"a{i}"] = arith.reward(p, [text])
    for i, p in enumerate(lake.make_prompts("train", 5, seed=1)):
        path = shortest_path(p.question.split("\n"))
        texts = path if i % 2 else ["U"] + path[:-1]
        pool.submit(RewardJob(f"f{i}", "frozenlake", {"max_turns": 12}, p, texts))
        expected[f"f{i}"] = lake.reward(p, texts)
    got = collect(pool, len(expected))
    assert {k: o.reward for k, o in got.items()} == expected
    assert not any(o.error for o in got.values())
    assert 0 < sum(expected.values()) < len(expected)  # both outcomes were exercised


def test_failures_are_reported_as_data(pool_factory):
    task = get_task("arithmetic")
    p = task.make_prompts("train", 1)[0]
    pool = pool_factory(2, 10.0, reward_fn=SCORER)
    for key in ("raise", "exit", "nan", "print"):
        pool.submit(RewardJob(key, "arithmetic", {}, p, [key]))
    pool.submit(RewardJob("bad-task", "chess", {}, p, ["1"]))
    pool.submit(RewardJob("bad-prompt", "arithmetic", {}, {"task": "arithmetic"}, ["1"]))
    pool.submit(RewardJob("good", "arithmetic", {}, p, [p.answer]))
    got = collect(pool, 7)
    assert got["raise"].error == "ZeroDivisionError: the reward rule divided by zero"
    assert got["exit"].error == "reward worker died (exit code 7)"
    assert "returned nan" in got["nan"].error
    assert got["print"].error == "" and got["print"].reward == 0.0
    assert "task: must be one of" in got["bad-task"].error
    assert got["bad-prompt"].error.startswith("ValidationError") and "$.prompt" in got["bad-prompt"].error
    assert got["good"].reward == 1.0 and got["good"].error == ""
    assert all(o.reward == 0.0 for k, o in got.items() if k != "good")
    assert pool.died == 1


def test_looping_reward_is_killed_at_the_timeout_and_the_pool_recovers(pool_factory):
    task = get_task("arithmetic")
    p = task.make_prompts("train", 1)[0]
    pool = pool_factory(2, 1.0, reward_fn=SCORER)
    collect(pool, 0)
    deadline = time.monotonic() + 10
    while pool.ready < 2 and time.monotonic() < deadline:
        pool.poll(0.05)
    before = set(pool.pids())
    t0 = time.monotonic()
    pool.submit(RewardJob("loop", "arithmetic", {}, p, ["loop"]))
    pool.submit(RewardJob("meanwhile", "arithmetic", {}, p, [p.answer]))
    got = collect(pool, 2)
    took = time.monotonic() - t0
    assert got["loop"].error == "timeout after 1s" and got["loop"].reward == 0.0
    assert got["meanwhile"].reward == 1.0  # the other worker kept serving
    assert took >= 1.0  # killed at its timeout, not before
    assert pool.killed == 1
    killed = before - set(pool.pids())
    assert len(killed) == 1
    pid = killed.pop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # really gone, not left spinning
    # A replacement joins, and both workers serve again.
    for i in range(6):
        pool.submit(RewardJob(f"after{i}", "arithmetic", {}, p, ["slow" if i < 2 else p.answer]))
    after = collect(pool, 6)
    assert all(o.error == "" for o in after.values())
    assert len(pool.pids()) == 2


def test_a_bad_reward_function_path_fails_at_construction():
    with pytest.raises(ValueError, match="must be 'module:function'"):
        RewardPool(1, 1.0, reward_fn="no_colon")
    with pytest.raises(ModuleNotFoundError):
        RewardPool(1, 1.0, reward_fn="no_such_module_xyz:f")
    with pytest.raises(ValueError, match="workers: must be >= 1, got 0"):
        RewardPool(0, 1.0)


def test_a_batch_loses_only_its_looping_or_dying_job(pool_factory):
    """One worker gets all of the queue in one message: the looping job is killed at its
    own timeout, the job that kills its worker fails alone, and the jobs of the batch not
    answered yet run again on the replacement, each reported exactly once (collect checks)."""
    task = get_task("arithmetic")
    p = task.make_prompts("train", 1)[0]
    pool = pool_factory(1, 1.0, reward_fn=SCORER)
    deadline = time.monotonic() + 10
    while pool.ready < 1 and time.monotonic() < deadline:
        pool.poll(0.05)
    texts = {"before": p.answer, "loop": "loop", "after": p.answer, "exit": "exit", "last": "0"}
    for key, text in texts.items():
        pool.submit(RewardJob(key, "arithmetic", {}, p, [text]))
    got = collect(pool, len(texts))
    assert got["loop"].error == "timeout after 1s"
    assert got["exit"].error == "reward worker died (exit code 7)"
    assert (got["before"].reward, got["after"].reward, got["last"].reward) == (1.0, 1.0, 0.0)
    assert not any(got[k].error for k in ("before", "after", "last"))
    # One worker killed at the looping job's timeout, not one timeout per job of the batch.
    assert pool.killed == 1 and pool.died == 1 and pool.queued == 0
