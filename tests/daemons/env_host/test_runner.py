"""The env-host data path in process: real etcd claims, a fake rollout and a fake reward-host
on real sockets, the journal on disk — including a restart that resumes the journal and
the adoption of a claim that was made in etcd but never journaled."""

from __future__ import annotations

import json
import threading

import pytest

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.wire.messages import Trajectory
from rlfleet.common.wire.outbox import OutboxThread
from rlfleet.common.wire.reliable import ReliableReceiver
from rlfleet.daemons.env_host.claims import PromptClaimer, parse_cursor
from rlfleet.daemons.env_host.journal import TrajectoryJournal
from rlfleet.daemons.env_host.manager import ManagerConfig, TurnCodec
from rlfleet.daemons.env_host.runner import EnvRunner
from rlfleet.daemons.tasks import get_task
from rlfleet.daemons.tasks.prompts import PromptStream, parse_trajectory_id, trajectory_id
from tests.integration.helpers import wait_for

from .fakes import FakeRollout, policy, tokenizer

G = 2
KEYS = JobKeys("runner")


def solve(text: str) -> str:
    a, op, b = text.removesuffix("=").partition("+") if "+" in text else text.removesuffix("=").partition("-")
    return str(int(a) + int(b) if op == "+" else int(a) - int(b))


class FakeRewardHost:
    """Acks trajectories while `acking` is set; keeps every copy it received."""

    def __init__(self) -> None:
        self.receiver = ReliableReceiver("tcp://127.0.0.1:0", expect=Trajectory, name="fake-rh")
        self.copies: list[Trajectory] = []
        self.acking = threading.Event()
        self.acking.set()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._halt.is_set():
                for key, msg in self.receiver.drain(0.02):
                    self.copies.append(msg)
                    if self.acking.is_set():
                        self.receiver.ack([key])
        finally:
            self.receiver.close()

    def unique(self) -> dict[str, Trajectory]:
        return {t.trajectory_id: t for t in list(self.copies)}

    def close(self) -> None:
        self._halt.set()
        self._thread.join(5)


@pytest.fixture
def world(etcd, tmp_path):
    store = EtcdStore(etcd.endpoints)
    rollout = FakeRollout(policy(solve))
    reward_host = FakeRewardHost()
    yield store, rollout, reward_host, tmp_path / "env-0.jsonl"
    reward_host.close()
    rollout.close()
    store.close()


class Host:
    """One env-host incarnation: journal + outbox + runner (what EnvHost.setup builds)."""

    def __init__(self, store, rollout, reward_host, path, owner: str = "env-0",
                 group_size: int = G, max_concurrent: int = 8, *, task=None, config=None,
                 journal_cls=TrajectoryJournal, **runner_options) -> None:
        """``runner_options``: EnvRunner's env_mode / redundant_* (test_agentic_modes.py)."""
        task = task or get_task("arithmetic")
        launch = group_size + runner_options.get("redundant_samples", 0)
        self.journal = journal_cls(path, launch)
        self.claimer = PromptClaimer(store, KEYS, owner)
        self.outbox = OutboxThread("test-outbox", on_acked=lambda acked: self.runner.on_acked(acked),
                                   resend_after_s=0.3, max_backoff_s=0.5)
        self.runner = EnvRunner(
            task=task, stream=PromptStream(task, seed=0), codec=TurnCodec(tokenizer()),
            config=config or ManagerConfig(turn_timeout_s=2.0, trajectory_timeout_s=5.0, max_retries=1),
            group_size=group_size, max_concurrent=max_concurrent, journal=self.journal,
            claim=self.claimer.claim, recent_claims=self.claimer.recent, submit=self.outbox.submit,
            name=owner, **runner_options)
        self.outbox.set_addresses([reward_host.receiver.endpoint])
        self.runner.set_rollouts({"r0": rollout.address})
        self.outbox.start()
        self.runner.start()

    def stop(self) -> None:
        self.runner.stop()
        self.outbox.stop()
        self.outbox.join(5)
        self.journal.close()


def check_accounting(store, reward_host: FakeRewardHost, path,
                     foreign: frozenset[int] = frozenset()) -> tuple[int, set[int]]:
    """Every prompt we claimed is delivered (all G trajectories) or live in the journal."""
    nxt, _ = parse_cursor(store.get(KEYS.prompts_cursor).value)
    live = set(TrajectoryJournal(path, G).live_prompts())
    delivered = reward_host.unique()
    assert {parse_trajectory_id(t)[0] for t in delivered} <= set(range(nxt))
    for p in range(nxt):
        if p not in live and p not in foreign:
            missing = [trajectory_id(p, k) for k in range(G) if trajectory_id(p, k) not in delivered]
            assert not missing, f"prompt {p} neither delivered nor in flight: {missing}"
    return nxt, live


def test_claims_runs_and_resumes_the_journal_after_a_restart(world):
    store, rollout, reward_host, path = world
    host = Host(store, rollout, reward_host, path)
    wait_for("20 trajectories delivered", lambda: len(reward_host.unique()) >= 20, timeout_s=30)
    wait_for("the loop-lag probe ticking on the env loop", lambda: host.runner.lag_probe.samples >= 2,
             timeout_s=10)
    # The reward-host stops acking: finished trajectories pile up unacked, claiming stops.
    reward_host.acking.clear()
    passes = host.runner.held_back
    wait_for("the claim loop held back", lambda: host.runner.held_back > passes, timeout_s=30)
    claimed_before, passes = host.runner.claimed, host.runner.held_back
    wait_for("two more passes of the claim loop", lambda: host.runner.held_back >= passes + 2, timeout_s=30)
    assert host.runner.claimed == claimed_before, "claimed more while nothing was acked"
    assert host.runner.live_prompts <= 2 * (8 // G)  # back-pressure: twice the prompts max_concurrent runs
    host.stop()
    unacked = {tid for tid, s in TrajectoryJournal(path, G).trajectories.items() if s.done and not s.acked}
    assert unacked, "nothing was waiting for an ack: the restart would test nothing"

    delivered_before = set(reward_host.unique())
    copies_before = len(reward_host.copies)
    reward_host.acking.set()
    host = Host(store, rollout, reward_host, path)  # same id, same journal
    wait_for("the unacked trajectories re-sent and acked",
             lambda: unacked <= {t.trajectory_id for t in reward_host.copies[copies_before:]}
             and not (unacked & {tid for tid, s in host.journal.trajectories.items() if not s.acked}),
             timeout_s=30)
    wait_for("new work after the restart", lambda: len(reward_host.unique()) >= len(delivered_before) + 10,
             timeout_s=30)
    host.stop()
    nxt, live = check_accounting(store, reward_host, path)
    assert nxt >= 15
    for t in reward_host.unique().values():
        assert t.dropped_reason == "" and t.env_reward == 1.0  # the fake rollout solves every one


def test_a_claim_lost_between_etcd_and_the_journal_is_adopted(world):
    store, rollout, reward_host, path = world
    # A previous incarnation claimed [0, 3) in etcd and died before journaling it.
    assert PromptClaimer(store, KEYS, "env-0").claim(3) == range(0, 3)
    PromptClaimer(store, KEYS, "env-other").claim(2)  # someone else's: not ours to adopt
    host = Host(store, rollout, reward_host, path)
    adopted = {trajectory_id(p, k) for p in range(3) for k in range(G)}
    wait_for("the adopted prompts delivered", lambda: adopted <= set(reward_host.unique()), timeout_s=30)
    host.stop()
    assert not {3, 4} & {parse_trajectory_id(t)[0] for t in reward_host.unique()}
    check_accounting(store, reward_host, path, foreign=frozenset({3, 4}))


class FullDiskJournal(TrajectoryJournal):
    """While ``full`` is set every write fails as a full disk does (ENOSPC, the lines kept
    in memory for the next write: what TrajectoryJournal._write does on a short write)."""

    full = False

    def _write(self) -> None:
        if self.full:
            raise OSError(28, f"{self.path}: no space left (test)")
        super()._write()


def test_a_full_disk_holds_finished_trajectories_and_hands_them_on_once_written(world):
    """A trajectory whose "done" line a full disk refused used to stay live for good (its
    prompt never completed), and a claim that could not be journaled ended the env loop.
    Now both wait in memory: nothing leaves before the journal holds it, and everything
    goes once the disk has room."""
    store, rollout, reward_host, path = world
    host = Host(store, rollout, reward_host, path, journal_cls=FullDiskJournal)
    wait_for("10 trajectories delivered", lambda: len(reward_host.unique()) >= 10, timeout_s=30)
    host.journal.full = True
    wait_for("trajectories held by the full disk", lambda: len(host.runner._held) >= 2, timeout_s=30)
    wait_for("a claim made while the disk is full",
             lambda: host.runner.claimed > max(parse_trajectory_id(t)[0] for t in reward_host.unique()) + 1,
             timeout_s=30)
    sent_while_full = set(reward_host.unique())
    # Read, not opened: a second TrajectoryJournal on the live file would compact it under the first.
    lines = [json.loads(raw) for raw in path.read_bytes().splitlines()]
    on_disk = {r["id"] for r in lines if r["t"] in ("done", "spare")}
    held = {tid for tid, *_ in host.runner._held}
    assert not held & on_disk and not held & sent_while_full, "a held trajectory left before it was journaled"
    assert host.runner.alive(), host.runner.error
    host.journal.full = False
    wait_for("the held trajectories handed on", lambda: held <= set(reward_host.unique()), timeout_s=30)
    claimed = host.runner.claimed
    wait_for("new claims after the disk has room", lambda: host.runner.claimed > claimed, timeout_s=30)
    host.stop()
    nxt, live = check_accounting(store, reward_host, path)
    assert nxt >= claimed and host.runner.error is None
