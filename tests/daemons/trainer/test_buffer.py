"""The buffer policy (RollArt §6.2): the staleness bound α checked on every pass over
every pending group, the (1 + α) x batch bound, and the three orders — as functions and
in the training loop with a real journal (every group ends trained or dropped with a
reason)."""

from __future__ import annotations

import threading
import time

import pytest

from rlfleet.common.failpoints import TRAINER_STEP_DELAY_S as STEP_DELAY_ENV
from rlfleet.common.failpoints import trainer_step_delay_s as step_delay_s
from rlfleet.common.spec.errors import SpecError
from rlfleet.common.spec.job import load_spec, parse_spec
from rlfleet.daemons.trainer import buffer
from rlfleet.daemons.trainer.journal import ExperienceJournal
from rlfleet.daemons.trainer.metrics_log import MetricsLog
from rlfleet.daemons.trainer.training import TrainerState, TrainingLoop
from tests.integration.helpers import TINY_MODEL

from .conftest import scored
from .test_parts import FakeLearner, Recorder


def group(p, versions, reward=1.0):
    return (f"p{p}", [scored(p, k, reward, version=v) for k, v in enumerate(versions)])


def test_evict_stale_looks_at_every_pending_group_complete_or_not():
    pending = [group(0, [5, 5]), group(1, [3]), group(2, [4, 2]), group(3, [6, 6])]
    # trainer at version 6, alpha 2: p1 (staleness 3, one trajectory of two) and p2
    # (its second trajectory, 4) can never be trained; p0 (1) and p3 (0) stay
    assert buffer.evict_stale(pending, trainer_version=6, max_staleness=2) == [
        ("p1", "staleness", "p1-g0: staleness 3 > max_staleness 2"),
        ("p2", "staleness", "p2-g1: staleness 4 > max_staleness 2")]
    assert buffer.evict_stale(pending, 6, None) == []
    assert buffer.evict_stale(pending, 6, 4) == []  # at the bound is kept


def test_orders_and_the_overflow_tail():
    complete = [group(0, [4, 4]), group(1, [2, 4]), group(2, [4, 4]), group(3, [3, 3])]  # completion order
    names = lambda gs: [g for g, _ in gs]  # noqa: E731
    assert names(buffer.ordered(complete, "fifo", 4)) == ["p0", "p1", "p2", "p3"]
    assert names(buffer.ordered(complete, "newest", 4)) == ["p3", "p2", "p1", "p0"]
    # stalest first (p1: 2, p3: 1), equal staleness keeps completion order (p0 before p2)
    assert names(buffer.ordered(complete, "staleness", 4)) == ["p1", "p3", "p0", "p2"]
    with pytest.raises(ValueError, match="buffer_order must be one of fifo, newest, staleness, got 'lifo'"):
        buffer.ordered(complete, "lifo", 4)
    # (1 + alpha) batches of B/G = 1 group, alpha 2: 3 groups; the last in the order goes
    assert buffer.capacity_groups(1, 2) == 3 and buffer.capacity_groups(1, None) is None
    newest = buffer.ordered(complete, "newest", 4)
    assert buffer.evict_overflow(newest, 3, "newest") == [
        ("p0", "buffer_full", "4 complete groups > (1 + max_staleness) x batch = 3; the last in 'newest' order")]
    assert buffer.evict_overflow(newest, 4, "newest") == [] and buffer.evict_overflow(newest, None, "fifo") == []


def test_the_spec_option_and_its_values(tmp_path):
    base = f'[job]\nname = "b"\n[model]\npath = "{TINY_MODEL}"\n[task.env]\nkind = "arithmetic"\n[trainer]\n'
    path = tmp_path / "b.toml"
    path.write_text(base)
    assert load_spec(path).trainer.buffer_order == "fifo"
    path.write_text(base + 'buffer_order = "staleness"\n')
    assert load_spec(path).trainer.buffer_order == "staleness"
    path.write_text(base + 'buffer_order = "lifo"\n')
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert len(info.value.errors) == 1 and "trainer.buffer_order" in info.value.errors[0]
    assert "'fifo'" in info.value.errors[0] and "'lifo'" in info.value.errors[0]


def run_loop(tmp_path, journal, learner, trainer: dict, until, timeout_s: float = 30.0):
    spec = parse_spec({"job": {"name": "t"}, "model": {"path": str(TINY_MODEL)},
                       "task": {"env": {"kind": "arithmetic"}, "group_size": 2},
                       "trainer": {"batch_size": 4, "checkpoint_every": 100, **trainer}})
    recorder = Recorder()
    loop = TrainingLoop(spec=lambda: spec, journal=journal, learner=learner, publisher=None,
                        checkpointer=recorder, evaluator=None,  # type: ignore[arg-type]
                        metrics=MetricsLog(tmp_path / "metrics.jsonl"), state=TrainerState(),
                        wake=threading.Event())
    stop = threading.Event()
    thread = threading.Thread(target=loop.run, args=(stop,), daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    try:
        while not until(loop) and time.monotonic() < deadline:
            loop.wake.wait(0.05)
        assert until(loop), f"not reached in {timeout_s} s: status {loop.state.status}"
    finally:
        stop.set()
        loop.wake.set()
        thread.join(10)
    return loop


ST, BF = "staleness", "buffer_full"


@pytest.mark.parametrize("order, first_batch, dropped, left", [
    # p2, p3 train at version 3 -> 4; then p4 (made at version 2) is 2 behind: evicted;
    # p5 waits for a partner group
    ("fifo", ["p2", "p3"], {"p0": ST, "p1": ST, "p6": BF, "p7": BF, "p4": ST}, {"p5"}),
    ("newest", ["p7", "p6"], {"p0": ST, "p1": ST, "p2": BF, "p3": BF, "p4": ST}, {"p5"}),
    # the stalest first: p4 trains before it crosses alpha, and nothing else is lost
    ("staleness", ["p4", "p2"], {"p0": ST, "p1": ST, "p6": BF, "p7": BF}, set()),
])
def test_the_loop_evicts_before_each_batch_and_accounts_for_every_group(tmp_path, order, first_batch,
                                                                        dropped, left):
    with ExperienceJournal(tmp_path / "j.bin", fsync=False) as journal:
        journal.append_trajectories(
            [st for p, versions in [(0, [1, 1]), (1, [0]), (2, [3, 3]), (3, [3, 3]), (4, [2, 3]),
                                    (5, [3, 3]), (6, [3, 3]), (7, [3, 3])]
             for st in group(p, versions)[1]])
        learner = FakeLearner()
        learner.version = 3  # alpha 1: p0 (staleness 2) and the incomplete p1 (3) are beyond it
        state = journal.state
        run_loop(tmp_path, journal, learner, {"max_staleness": 1, "buffer_order": order, "max_steps": 10},
                 until=lambda loop: len(state.dropped) + len(state.trained) == 8 - len(left)
                 and loop.state.status == "waiting")
        # 6 complete fresh groups > (1 + 1) x 2 = 4: the two at the tail of the order go
        assert {g: reason for g, (reason, _) in state.dropped.items()} == dropped
        assert state.dropped["p1"][1] == "p1-g0: staleness 3 > max_staleness 1"
        assert learner.batches[0] == sorted(f"{g}-g{k}" for g in first_batch for k in (0, 1))
        # every group of the 8 ends trained, dropped with a reason, or still pending
        assert set(state.trained) | set(state.dropped) | set(state.pending) == {f"p{p}" for p in range(8)}
        assert set(state.pending) == left and not set(state.trained) & set(state.dropped)
        assert sum(journal.summary()["dropped"].values()) == len(dropped)


def test_without_a_bound_nothing_is_evicted(tmp_path):
    with ExperienceJournal(tmp_path / "j.bin", fsync=False) as journal:
        journal.append_trajectories([st for p in range(6) for st in group(p, [0, 0])[1]])
        learner = FakeLearner()
        learner.version = 50
        run_loop(tmp_path, journal, learner, {"max_steps": 53}, until=lambda loop: loop.state.status == "done")
        assert not journal.state.dropped and len(journal.state.trained) == 6


def test_step_delay_slows_the_trainer(tmp_path, monkeypatch):
    monkeypatch.setenv(STEP_DELAY_ENV, "bad")
    with pytest.raises(ValueError, match=f"{STEP_DELAY_ENV} must be a number of seconds >= 0, got 'bad'"):
        step_delay_s()
    monkeypatch.setenv(STEP_DELAY_ENV, "-1")
    with pytest.raises(ValueError):
        step_delay_s()
    monkeypatch.setenv(STEP_DELAY_ENV, "0.4")
    assert step_delay_s() == 0.4
    with ExperienceJournal(tmp_path / "j.bin", fsync=False) as journal:
        journal.append_trajectories([st for p in range(6) for st in group(p, [0, 0])[1]])
        started = time.monotonic()
        run_loop(tmp_path, journal, FakeLearner(), {"max_steps": 3}, until=lambda loop: loop.state.status == "done")
        # three steps, each followed by the delay before the next pass (a lower bound: a busy
        # machine only makes it longer)
        assert time.monotonic() - started >= 3 * 0.4
