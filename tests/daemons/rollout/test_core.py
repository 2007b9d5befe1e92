"""RolloutCore in process, over the sim engine on a hand-driven clock: the coordination
modes' version rules, partial-mode continuation, repack orders. No sockets: the core's
replies are recorded (the core only leaves them in ``take_replies``)."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from rlfleet.common.wire.arrays import Int32Array
from rlfleet.common.wire.messages import GenerateRequest, GenerateResult, RepackOrder
from rlfleet.daemons.rollout.core import RolloutCore
from rlfleet.daemons.rollout.engines.kinds import SimEngineConfig
from rlfleet.daemons.rollout.sim.engine import SimEngine

VOCAB, EOS = 1000, 0


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Server:
    """Sends what its core leaves to send (the core's owner does that), and records it."""

    def __init__(self) -> None:
        self._sent: list[tuple[str, object]] = []
        self.core: RolloutCore | None = None

    def attach(self, core: RolloutCore) -> RolloutCore:
        self.core = core
        return core

    @property
    def replies(self) -> list[tuple[str, object]]:
        assert self.core is not None
        self._sent += [(rid, msg) for _, rid, msg in self.core.take_replies()]
        return self._sent

    def results(self) -> dict[str, GenerateResult]:
        return {m.request_id: m for _, m in self.replies if isinstance(m, GenerateResult)}


class Reader:
    def __init__(self, newest: int | None = None) -> None:
        self.versions = set() if newest is None else set(range(newest + 1))

    def newest(self) -> int | None:
        return max(self.versions) if self.versions else None

    @contextmanager
    def open(self, version: int | None = None):
        if version not in self.versions:
            raise LookupError(version)
        yield SimpleNamespace(version=version, tensors={})


def engine(clock: Clock, median: int = 200) -> SimEngine:
    config = SimEngineConfig.model_validate({
        "kind": "sim", "time_scale": 0.01, "max_batch": 8, "roofline_batch": 8, "load_s": 0.0,
        "lengths": {"kind": "lognormal", "median": median, "p99": median * 1.01}})
    return SimEngine.from_config(config, vocab_size=VOCAB, eos_token_id=EOS, clock=clock)


def request(rid: str, required: int | None = None, max_new: int = 4000) -> GenerateRequest:
    return GenerateRequest(rid, f"t-{rid}", Int32Array([5, 6, 7, int(rid[-1]) + 10]), max_new, 1.0, 1.0,
                           required_version=required)


def run_until_done(core: RolloutCore, server: Server, clock: Clock, ids: list[str],
                   reader: Reader | None = None) -> dict[str, GenerateResult]:
    for _ in range(10_000):
        core.tick(clock.t, reader)
        if set(ids) <= set(server.results()):
            return server.results()
        at = core.engine.next_event_at()  # type: ignore[attr-defined]
        clock.t = max(clock.t + 0.001, at if at is not None else clock.t + 0.01)
    raise AssertionError(f"not answered: {set(ids) - set(server.results())}")


def test_a_continuation_for_a_version_this_rollout_does_not_hold_is_refused_at_once():
    clock, server = Clock(), Server()
    core = server.attach(RolloutCore(engine(clock), "r0", mode="trajectory"))
    core.on_message(b"c", "1", request("a1", required=3), clock.t)
    (_, reply), = server.replies
    assert reply.finish_reason == "version" and "requires weight version 3" in reply.error
    assert not core.engine.has_work()


def test_sync_mode_holds_a_request_for_the_next_version_until_the_batch_drains():
    clock, server = Clock(), Server()
    core = server.attach(RolloutCore(engine(clock), "r0", mode="sync"))
    reader = Reader(newest=1)
    core.on_message(b"c", "1", request("a1", required=0), clock.t)
    core.tick(clock.t, reader)
    core.on_message(b"c", "2", request("b2", required=1), clock.t)
    core.tick(clock.t, reader)
    assert core.engine.weight_version == 0 and len(core.held) == 1  # a1 still runs on 0
    got = run_until_done(core, server, clock, ["a1", "b2"], reader)
    assert got["a1"].weight_version == 0 and got["b2"].weight_version == 1
    assert got["a1"].finish_reason == got["b2"].finish_reason == "stop"


def test_barrier_mode_never_loads_the_newest_version_on_its_own():
    clock, server = Clock(), Server()
    core = server.attach(RolloutCore(engine(clock), "r0", mode="one_step_off"))
    reader = Reader(newest=5)
    core.on_message(b"c", "1", request("a1", required=0), clock.t)
    got = run_until_done(core, server, clock, ["a1"], reader)
    assert got["a1"].weight_version == 0 and core.engine.weight_version == 0


def test_partial_mode_interrupts_and_continues_with_one_segment_per_version():
    clock, server = Clock(), Server()
    # The same request on an engine that never changes version: the tokens to expect.
    ref_clock, ref_server = Clock(), Server()
    ref_core = ref_server.attach(RolloutCore(engine(ref_clock), "ref", mode="partial"))
    ref_core.on_message(b"c", "1", request("a1"), ref_clock.t)
    expected = run_until_done(ref_core, ref_server, ref_clock, ["a1"])["a1"]

    core = server.attach(RolloutCore(engine(clock), "r0", mode="partial"))
    reader = Reader(newest=0)
    core.on_message(b"c", "1", request("a1"), clock.t)
    core.tick(clock.t, reader)
    clock.t += expected.token_ids.size * 0.01 * 0.0065 / 2  # about half way
    core.tick(clock.t, reader)
    reader.versions.add(1)
    core.tick(clock.t, reader, newest=1)  # new version: interrupted, loaded, continued here
    assert core.engine.weight_version == 1
    got = run_until_done(core, server, clock, ["a1"], reader)["a1"]
    assert got.token_ids.tolist() == expected.token_ids.tolist()
    assert [s.version for s in got.segments] == [0, 1]
    assert sum(s.tokens for s in got.segments) == got.token_ids.size
    assert got.weight_version == 0  # the oldest segment's


def test_a_repack_order_hands_running_requests_over_once():
    clock, server = Clock(), Server()
    core = server.attach(RolloutCore(engine(clock), "r0", mode="trajectory"))
    for rid in ("a1", "a2"):
        core.on_message(b"c", rid, request(rid), clock.t)
    core.tick(clock.t, Reader(newest=0))
    clock.t += 0.001
    order = RepackOrder("plan-0", "r0", "r7", [])
    core.on_message(b"m", "o1", order, clock.t)
    results = server.results()
    assert {r.finish_reason for r in results.values()} == {"abort"}
    assert {r.continue_on for r in results.values()} == {"r7"}
    ack = server.replies[-1][1]
    assert ack.ok and set(ack.ids) == {"plan-0", "a1", "a2"}
    core.on_message(b"c", "a3", request("a3"), clock.t)
    core.tick(clock.t, Reader(newest=0))
    core.on_message(b"m", "o2", order, clock.t)  # the same order again: the same answer
    assert server.replies[-1][1] == ack and core.engine.running_ids() == ["a3"]


@pytest.mark.parametrize("order,why", [(RepackOrder("p", "r9", "r7", []), "order for r9"),
                                       (RepackOrder("q", "r0", "r0", []), "onto itself")])
def test_a_repack_order_for_someone_else_or_onto_itself_is_refused(order, why):
    clock, server = Clock(), Server()
    core = server.attach(RolloutCore(engine(clock), "r0"))
    core.on_message(b"m", "o", order, clock.t)
    ack = server.replies[-1][1]
    assert not ack.ok and why in ack.error
