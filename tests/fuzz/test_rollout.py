"""A rollout's requests socket under hostile but decodable requests, against a real
rollout daemon hosting one simulated rollout (sim engine: no torch, the tiny model's
vocabulary), a real etcd, and a real RequestClient.

A hostile GenerateRequest, Abort or RepackOrder is answered at once with the
protocol's refusal (an error GenerateResult, a negative Ack), a hostile stats request
is dropped; each is counted in rlfleet_rejected_messages_total; the daemon serves on
and generates for the valid request sent after them."""

from __future__ import annotations

from hypothesis import given

from rlfleet.common.wire.arrays import Int32Array
from rlfleet.common.wire.messages import Ack, GenerateRequest, GenerateResult, RepackOrder, RolloutStats, WireError
from rlfleet.common.wire.sockets import PeerTimeout, RequestClient
from rlfleet.common.wire.validation import Limits, check_message
from rlfleet.daemons.trainer.sim_learner import read_vocab_size
from tests.integration.helpers import TINY_MODEL, wait_for

from . import strategies as hs
from .conftest import DAEMON_FUZZ
from .harness import DaemonProcess

SPEC = """
[rollout.engine]
kind = "sim"
rollouts = 1
time_scale = 0.01
max_batch = 4
roofline_batch = 4

[rollout.engine.lengths]
kind = "lognormal"
median = 8
p99 = 12
"""


def _hostile(msg, vocab: int) -> bool:
    try:
        check_message(msg, Limits(vocab_size=vocab))
    except WireError:
        return True
    return False


def test_hostile_requests_are_refused_and_a_valid_one_is_served(tmp_path, etcd):
    vocab = read_vocab_size(TINY_MODEL)
    d = DaemonProcess(tmp_path, etcd, "rollout", "sim", "fuzzro", SPEC, model=TINY_MODEL)
    try:
        wait_for("the host's record", d.record, timeout_s=60)
        sim_id = "sim-00"
        address = wait_for("the simulated rollout's address", lambda: (
            d.store.get(d.keys.member("rollout", sim_id)) or None) and d.store.get(
                d.keys.member("rollout", sim_id)).value["addresses"]["requests"], timeout_s=30)
        client = RequestClient(address, expect=(GenerateResult, RolloutStats, Ack))
        hostile = 0

        @DAEMON_FUZZ
        @given(hs.rollout_requests)
        def send_one(msg) -> None:
            nonlocal hostile
            if not _hostile(msg, vocab):
                return  # a valid request: served as any other (the end of the test checks one)
            hostile += 1
            if isinstance(msg, RolloutStats):
                client.send(msg)  # no refusal in the protocol: only counted
                return
            reply = client.request(msg, 20.0)  # refused at once, not after a timeout
            if isinstance(msg, RepackOrder):
                assert isinstance(reply, Ack) and not reply.ok and "rejected" in reply.error
            else:
                assert isinstance(reply, GenerateResult) and reply.finish_reason == "error"
                assert reply.error.startswith("rejected: ")
            assert d.alive(), d.tail()

        send_one()
        assert hostile >= 10
        wait_for("every hostile request counted",
                 lambda: d.rejected(role="rollout") >= hostile, timeout_s=10)
        ok = client.request(GenerateRequest("valid-1", "t", Int32Array([1, 2, 3]), 4, 1.0, 1.0),
                            30.0)
        assert isinstance(ok, GenerateResult) and ok.finish_reason in ("stop", "length"), ok
        assert 0 < len(ok.token_ids) <= 4
        client.close()
        assert d.alive()
    except PeerTimeout:
        raise AssertionError(d.tail()) from None
    finally:
        assert d.close() == 0, d.tail()
