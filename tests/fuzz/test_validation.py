"""Properties of the content checks (common/wire/validation.py), in process, many examples:
a hostile message is rejected with a content reason and nothing else; what passes is
safe to carry on (int64, finite, bounded, 1-D, in the vocabulary); a legitimate
message always passes; refusals are themselves sendable; rejections and handler
failures are counted on every message but logged once per kind."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlfleet.common import metrics
from rlfleet.common.wire import messages as wire
from rlfleet.common.wire.arrays import Array, Float32Array, Int32Array
from rlfleet.common.wire.messages import (
    CONTENT_REASONS,
    GenerateRequest,
    GenerateResult,
    Prompt,
    ScoredTrajectory,
    Segment,
    Trajectory,
    Turn,
    WireError,
    decode,
    encode,
)
from rlfleet.common.wire.validation import Limits, check_message, confined, error_reply

from . import strategies as hs

HOSTILE = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                   suppress_health_check=list(HealthCheck))
SETTINGS = settings(max_examples=400, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
VOCAB = 1000
any_message = st.one_of(hs.scored(), hs.trajectories(), hs.rollout_requests, hs.generate_results,
                        hs.acks)


def _leaves(obj):
    """Every scalar, string and array inside a message."""
    if isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _leaves(x)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(k)
            yield from _leaves(v)
    elif hasattr(obj, "__struct_fields__"):
        for name in obj.__struct_fields__:
            yield from _leaves(getattr(obj, name))
    else:
        yield obj


@HOSTILE
@given(any_message)
def test_a_decoded_message_passes_or_is_rejected_with_a_content_reason(msg) -> None:
    got = decode(encode(msg))
    try:
        check_message(got, Limits(vocab_size=VOCAB))
    except WireError as e:
        assert e.reason in CONTENT_REASONS
        return
    # What passes is safe to carry on: int64, bounded, 1-D, token ids in the vocabulary.
    for leaf in _leaves(got):
        if type(leaf) is int:
            np.int64(leaf)  # no OverflowError
        elif isinstance(leaf, str):
            assert len(leaf) <= Limits().max_text_chars
        elif isinstance(leaf, Array):
            assert len(leaf.shape) == 1 and leaf.size <= Limits().max_tokens
    for turn in getattr(getattr(got, "trajectory", got), "turns", ()):
        ids = turn.prompt_token_ids.tolist() + turn.token_ids.tolist()
        assert all(0 <= i < VOCAB for i in ids)
        assert turn.token_ids.size == turn.logprobs.size


ascii_ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_:.", min_size=1, max_size=64)
small = st.integers(0, 2**31)
finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
tokens = st.lists(st.integers(0, VOCAB - 1), max_size=30)


@st.composite
def legit_turns(draw) -> Turn:
    out = draw(tokens)
    return Turn(Int32Array(draw(tokens)), Int32Array(out),
                Float32Array([-abs(x) for x in draw(st.lists(finite, min_size=len(out),
                                                             max_size=len(out)))]),
                draw(small), draw(st.text(max_size=50)), draw(st.text(max_size=50)),
                [Segment(len(out), draw(small))] if out and draw(st.booleans()) else [])


legit = st.one_of(
    st.builds(ScoredTrajectory, st.builds(
        Trajectory, ascii_ids, small, ascii_ids, ascii_ids, st.lists(legit_turns(), max_size=3),
        finite, st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=3),
        st.just(""), st.one_of(st.none(), st.builds(Prompt, ascii_ids, ascii_ids, ascii_ids,
                                                    st.text(max_size=30), st.text(max_size=10),
                                                    small))),
        st.one_of(finite, st.just(float("nan"))), st.text(max_size=20)),
    st.builds(GenerateRequest, ascii_ids, ascii_ids, tokens.map(Int32Array), small, finite,
              finite, st.one_of(st.none(), small), st.one_of(st.none(), small), small),
)


@SETTINGS
@given(legit)
def test_a_legitimate_message_always_passes(msg) -> None:
    check_message(decode(encode(msg)), Limits(vocab_size=VOCAB))


def test_a_broken_rollout_result_is_left_to_the_env_host() -> None:
    # Its checks retry the turn elsewhere at once; a rejection would be a timeout.
    for r in (GenerateResult("r", Int32Array([5, 2]), Float32Array([-1.0]), 0, "stop"),
              GenerateResult("r", Int32Array([-5]), Float32Array([float("nan")]), -1, "stop")):
        check_message(decode(encode(r)), Limits(vocab_size=VOCAB))


def _traj(turn: Turn) -> Trajectory:
    return Trajectory("t", 0, "g", "a", [turn], 0.0)


@pytest.mark.parametrize("msg,reason", [
    (Trajectory("t", 0, "g", "a", [], 0.0,
                prompt=Prompt("arithmetic", "train", "u", "1+1", "2", seed=2**64 - 1)), "out_of_range"),
    (Trajectory("t", 2**63, "g", "a", [], 0.0), "out_of_range"),
    (Trajectory("t", 0, "g", "a", [], float("inf")), "not_finite"),
    (GenerateRequest("r", "t", Int32Array([1, VOCAB]), 4, 1.0, 1.0), "out_of_vocab"),
    (GenerateRequest("r", "t", Int32Array([-1]), 4, 1.0, 1.0), "out_of_vocab"),
    (GenerateRequest("r", "t", Int32Array([1]), 4, float("nan"), 1.0), "not_finite"),
    (GenerateRequest("r" * 300, "t", Int32Array([1]), 4, 1.0, 1.0), "bad_id"),
    (GenerateRequest("", "t", Int32Array([1]), 4, 1.0, 1.0), "bad_id"),
    (_traj(Turn(Int32Array([1]), Int32Array([1, 2]), Float32Array([0.0]), 0, "", "")),
     "inconsistent"),
    (_traj(Turn(Int32Array([1]), Int32Array([1]), Float32Array([0.0]), 0, "", "",
                [Segment(5, 0)])), "inconsistent"),
    (_traj(Turn(Int32Array([1]), Int32Array([1]), Float32Array([0.0]), -1, "", "")),
     "out_of_range"),
    (GenerateResult("r", Int32Array([1]), Float32Array([0.0]), 2**63, "stop"), "out_of_range"),
])
def test_each_kind_of_hostile_value(msg, reason) -> None:
    with pytest.raises(WireError) as e:
        check_message(decode(encode(msg)), Limits(vocab_size=VOCAB))
    assert e.value.reason == reason


def test_a_deeply_nested_prompt_is_only_text() -> None:
    # Nesting cannot reach a typed message; as text it is bounded like any string.
    nested = "[" * 600_000 + "]" * 600_000
    traj = Trajectory("t", 0, "g", "arithmetic", [], 0.0,
                      prompt=Prompt("arithmetic", "train", "u", nested, ""))
    with pytest.raises(WireError) as e:
        check_message(decode(encode(traj)))
    assert e.value.reason == "too_large"
    small = Prompt("arithmetic", "train", "u", "[" * 1000 + "]" * 1000, "")
    check_message(decode(encode(Trajectory("t", 0, "g", "a", [], 0.0, prompt=small))))


@HOSTILE
@given(st.one_of(hs.generate_requests, hs.aborts, hs.repack_orders))
def test_every_refusal_is_a_sendable_message(msg) -> None:
    reply = error_reply(decode(encode(msg)), "why")
    assert reply is not None
    assert decode(encode(reply)) == reply
    check_message(reply)  # the client takes it (it is not rejected in turn)


def _rejected(role: str, endpoint: str, kind: str) -> float:
    return metrics.REJECTED_MESSAGES.labels(role=role, endpoint=endpoint, kind=kind)._value.get()


def test_rejections_are_counted_every_time_and_logged_once_per_kind(caplog) -> None:
    wire._log_state.clear()
    before = _rejected("", "ep", "out_of_range")
    with caplog.at_level(logging.WARNING, logger="rlfleet.wire"):
        for _ in range(100):
            wire.record_rejection(WireError("out_of_range", "x" * 10_000), "ep")
        wire.record_rejection(WireError("bad_id", "y"), "ep")
    assert _rejected("", "ep", "out_of_range") - before == 100
    lines = [r for r in caplog.records if r.name == "rlfleet.wire"]
    assert len(lines) == 2  # one per kind
    assert all(len(r.getMessage()) < 1000 for r in lines)  # a hostile payload is not echoed


def test_a_handler_failure_is_confined_counted_and_logged_once_per_type(caplog) -> None:
    before = _rejected("", "handler-ep", "handler_error")
    with caplog.at_level(logging.ERROR, logger="rlfleet.wire"):
        for i in range(20):
            with confined("handler-ep"):
                raise (KeyError if i % 2 else ZeroDivisionError)("boom")
    assert _rejected("", "handler-ep", "handler_error") - before == 20
    logged = [r for r in caplog.records if "handler-ep" in r.getMessage()]
    assert len(logged) == 2 and all(r.exc_info for r in logged)  # with the traceback
    with pytest.raises(KeyboardInterrupt), confined("handler-ep"):
        raise KeyboardInterrupt
