"""The reward-host's Trajectory intake under hostile but decodable messages, against a
real reward-host process, a real etcd and a fake trainer (a real ReliableReceiver).

Each hostile trajectory is refused for good (a negative Ack, so the sender stops
resending), counted in rlfleet_rejected_messages_total, never forwarded to the trainer;
the daemon stays up and scores the valid trajectory sent after them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlfleet.common.control.keys import JobKeys
from rlfleet.common.wire.messages import Trajectory, WireError
from rlfleet.common.wire.reliable import ReliableSender
from rlfleet.common.wire.validation import check_message
from rlfleet.daemons.tasks import get_task
from tests.daemons.reward_host.fakes import FakeTrainer, trajectory
from tests.integration.helpers import wait_for

from . import strategies as hs
from .conftest import DAEMON_FUZZ
from .harness import DaemonProcess

SPEC = """
[reward_host.backend]
kind = "rule_pool"
workers = 1
timeout_s = 5
"""
ascii_keys = st.text(alphabet="abcdefghij0123456789-", min_size=1, max_size=24)


@pytest.fixture
def reward_host(tmp_path, etcd):
    trainer = FakeTrainer()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    d = DaemonProcess(tmp_path, etcd, "reward-host", "rh-0", "fuzzrh", SPEC, model=model)
    d.store.put(JobKeys("fuzzrh").member("trainer", "t-0"), {
        "id": "t-0", "role": "trainer", "state": "running", "leader": True,
        "addresses": {"trajectories": trainer.address}})
    # Resends well apart: a copy of a megabyte message every fraction of a second would
    # queue faster than a loaded test machine checks them (a flood, not what is tested).
    sender = ReliableSender(d.address("trajectories"), resend_after_s=5.0, max_backoff_s=10.0)
    yield d, sender, trainer
    sender.close()
    trainer.close()
    assert d.close() == 0, d.tail()


def _answer(sender: ReliableSender, key: str, timeout_s: float = 20.0) -> tuple[bool, str]:
    """Wait for the reward-host's Ack of key: (ok, error)."""
    got: dict[str, tuple[bool, str]] = {}

    def acked() -> bool:
        sender.poll(0.05)
        got.update({k: (ok, err) for k, ok, err in sender.take_acked()})
        return key in got

    wait_for(f"an answer for {key}", acked, timeout_s=timeout_s, every_s=0.0)
    return got[key]


def _valid_one_is_scored(d, sender, trainer, n: int) -> None:
    prompt = get_task("arithmetic").make_prompts("train", 1, seed=n)[0]
    t = trajectory(prompt, 900 + n, 0, prompt.answer)
    sender.send(t.trajectory_id, t)
    assert _answer(sender, t.trajectory_id) == (True, "")
    s = trainer.unique()[t.trajectory_id]
    assert s.reward == 1.0 and s.reward_error == ""


def _is_hostile(t: Trajectory) -> bool:
    try:
        check_message(t)
    except WireError:
        return True
    return False


def test_the_issue_cases_resent_do_not_stop_the_reward_host(reward_host):
    """The issue's report: a nested-JSON prompt and an int past int64, sent again and
    again. Before the fix both were taken and carried on to the trainer (an int64
    consumer there fails on the second); now both are refused, counted, and the
    reward-host serves on."""
    d, sender, trainer = reward_host
    prompt = get_task("arithmetic").make_prompts("train", 1)[0]
    nested = msgspec_replace(prompt, question="[" * 600_000 + "]" * 600_000)
    huge = msgspec_replace(prompt, seed=2**64 - 1)
    for k in range(10):
        for i, p in enumerate((nested, huge)):
            t = msgspec_replace(trajectory(p, i, k, p.answer), trajectory_id=f"bad-{i}-{k}")
            sender.send(t.trajectory_id, t)
            ok, error = _answer(sender, t.trajectory_id)
            assert not ok and error.startswith("rejected: "), error
    assert d.alive(), d.tail()
    assert d.rejected(role="reward-host", kind="too_large") >= 10  # a resend before the refusal arrived counts too
    assert d.rejected(role="reward-host", kind="out_of_range") >= 10
    assert not any(s.trajectory.trajectory_id.startswith("bad-") for s in trainer.copies)
    _valid_one_is_scored(d, sender, trainer, 0)
    log = d.tail(10**7)
    assert log.count("rejected message") == 2, "one line per kind, not one per message"
    assert len(log) < 200_000, "a rejected payload must not be echoed into the log"


def msgspec_replace(obj, **changes):
    import msgspec

    return msgspec.structs.replace(obj, **changes)


def test_hostile_trajectories_are_refused_and_the_valid_one_is_served(reward_host):
    d, sender, trainer = reward_host
    sent: list[Trajectory] = []

    @DAEMON_FUZZ
    @given(hs.trajectories(ascii_keys))
    def send_one(t: Trajectory) -> None:
        key = f"{t.trajectory_id}-{len(sent)}"
        t = msgspec_replace(t, trajectory_id=key)
        sent.append(t)
        sender.send(key, t)
        ok, error = _answer(sender, key)
        if _is_hostile(t):
            assert not ok and error.startswith("rejected: "), (key, error)
        assert d.alive(), d.tail()

    send_one()
    hostile = [t for t in sent if _is_hostile(t)]
    assert len(hostile) >= 10, "the strategy must mostly produce hostile messages"
    assert d.rejected(role="reward-host") >= len(hostile)
    # Nothing hostile went on to the trainer.
    assert all(not _is_hostile(s.trajectory) for s in trainer.copies)
    _valid_one_is_scored(d, sender, trainer, 1)
    assert d.alive()
