"""The trainer's ScoredTrajectory intake under hostile but decodable messages, against
a real trainer process (sim backend: no torch, the tiny model's vocabulary) leading
against a real etcd, fed by a real ReliableSender.

Structurally hostile messages are refused for good (negative Ack); untrainable content
that a legitimate but broken peer may send (a NaN reward, token ids outside the
vocabulary) drops its group durably and is acked, as before. Both are counted in
rlfleet_rejected_messages_total; the trainer serves on and takes a valid trajectory."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rlfleet.common.wire.messages import ScoredTrajectory, WireError
from rlfleet.common.wire.reliable import ReliableSender
from rlfleet.common.wire.validation import check_message
from rlfleet.daemons.trainer.sim_learner import read_vocab_size
from tests.daemons.trainer.conftest import claim_prompts, scored
from tests.integration.helpers import TINY_MODEL, wait_for

from . import strategies as hs
from .conftest import DAEMON_FUZZ
from .harness import DaemonProcess
from .test_reward_host import _answer, msgspec_replace

SPEC = """group_size = 2

[trainer]
batch_size = 2
max_steps = 1000

[trainer.backend]
kind = "sim"
time_scale = 0.01
fixed_s = 1.0
tokens_per_s = 1000.0
weight_mib = 1
"""
ascii_keys = st.text(alphabet="abcdefghij0123456789-", min_size=1, max_size=24)


def test_hostile_scored_trajectories_are_refused_and_a_valid_one_is_taken(tmp_path, etcd):
    vocab = read_vocab_size(TINY_MODEL)
    d = DaemonProcess(tmp_path, etcd, "trainer", "t-0", "fuzztr", SPEC, model=TINY_MODEL)
    claim_prompts(d.store, "fuzztr", up_to=1000)
    sender = None
    try:
        sender = ReliableSender(d.address("trajectories", timeout_s=90), resend_after_s=5.0,
                                max_backoff_s=10.0)
        refused = 0

        @DAEMON_FUZZ
        @given(hs.scored(ascii_keys))
        def send_one(s: ScoredTrajectory) -> None:
            nonlocal refused
            key = f"{s.trajectory.trajectory_id}-{refused}-{id(s)}"[:200]
            s = msgspec_replace(s, trajectory=msgspec_replace(s.trajectory, trajectory_id=key))
            try:
                check_message(s)
            except WireError:
                sender.send(key, s)
                ok, error = _answer(sender, key)
                assert not ok and error.startswith("rejected: "), (key, error)
                refused += 1
            assert d.alive(), d.tail()

        send_one()
        assert refused >= 10
        # A NaN reward and an out-of-vocabulary id: the group is dropped, the sender told why.
        nan = scored(7, 0, float("nan"))  # (the helper copies the reward into env_reward)
        nan = msgspec_replace(nan, trajectory=msgspec_replace(nan.trajectory, env_reward=0.0))
        for bad, why in ((nan, "invalid: p7-g0: reward is nan"),
                         (scored(8, 0, 1.0, tokens=(vocab,)), f"invalid: p8-g0 turn 0: token id {vocab} outside")):
            sender.send(bad.trajectory.trajectory_id, bad)
            ok, error = _answer(sender, bad.trajectory.trajectory_id)
            assert not ok and error.startswith(why), error
        wait_for("every rejection counted",
                 lambda: d.rejected(role="trainer") >= refused + 2, timeout_s=10)
        assert d.rejected(role="trainer", kind="invalid") == 2
        good = scored(9, 0, 1.0)
        sender.send(good.trajectory.trajectory_id, good)
        assert _answer(sender, good.trajectory.trajectory_id) == (True, "")
        # A well-formed trajectory of a prompt no env-host claimed: a squat on a group
        # that a real env-host will fill later. Refused, its group left alone.
        squat = scored(5000, 0, 1.0)
        sender.send(squat.trajectory.trajectory_id, squat)
        assert _answer(sender, squat.trajectory.trajectory_id) == (
            False, "identity: prompt 5000 was never claimed (the cursor is at 1000)")
        # An id completes its group once: a second p9-g0 with other turns is refused (the
        # first in is kept); a resend of the same turns, scored again, is a duplicate.
        other = scored(9, 0, 1.0, tokens=(11, 12))
        sender.send("p9-g0-again", other)
        assert _answer(sender, "p9-g0-again") == (False, "identity: p9-g0 is already in group p9 with other turns")
        sender.send("p9-g0-rescored", scored(9, 0, 0.5))
        assert _answer(sender, "p9-g0-rescored") == (True, "")
        assert d.alive()
    finally:
        if sender is not None:
            sender.close()
        assert d.close() == 0, d.tail()
