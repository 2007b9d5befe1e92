"""Hypothesis strategies for hostile but *decodable* data-plane messages.

Every example is a real wire message (common/wire/messages.py) that ``encode`` accepts and
``decode`` returns: the hostility is in the values, never in the framing (framing
garbage is covered by tests/common/wire/test_wire.py). Values are drawn from the edges the
receivers must survive: ints at and beyond the int64 range (msgpack carries up to
uint64), NaN and infinities, token ids outside any vocabulary, strings of deeply
nested JSON or of megabytes, ids that are empty, non-ASCII or absurdly long, empty and
huge lists, arrays whose lengths disagree, and 2-D arrays where 1-D ones belong.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from rlfleet.common.wire import messages as wire
from rlfleet.common.wire.arrays import Float32Array, Int32Array

U64_MAX = 2**64 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1

EDGE_INTS = [0, -1, 1, 2**31 - 1, 2**31, -(2**31) - 1, I64_MAX, I64_MAX + 1, U64_MAX, I64_MIN]

# Any int msgpack can carry, weighted towards the edges.
hostile_ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(I64_MIN, U64_MAX),
                         st.integers(-5, 5))
hostile_floats = st.one_of(st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0,
                                            1e308, -1e308, 5e-324]), st.floats())

NESTED_JSON = "[" * 100_000 + "]" * 100_000
DEEP_OBJECT = '{"a":' * 50_000 + "1" + "}" * 50_000


def _big(n: int) -> str:
    return "x" * n


hostile_text = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["", "\x00", "é" * 10, "\ud7ff", NESTED_JSON, DEEP_OBJECT, "1" * 5000,
                     _big(2 * 1024 * 1024)]),
)
# Ids: must survive the socket's id frame (ASCII, <= 256 bytes) when used as a key, but
# inside the body anything goes.
hostile_ids = st.one_of(st.text(max_size=12), st.sampled_from(["", " ", "é", "a" * 300,
                                                               _big(100_000), NESTED_JSON]))

_token_values = st.one_of(st.sampled_from([-1, -(2**31), 2**31 - 1, 151_936, 10**9]),
                          st.integers(-(2**31), 2**31 - 1), st.integers(0, 50))


@st.composite
def int32_arrays(draw: st.DrawFn) -> Int32Array:
    """Token ids: any int32 (negative, beyond every vocabulary), sometimes 2-D or empty."""
    values = draw(st.lists(_token_values, max_size=40))
    if values and draw(st.booleans()) and len(values) % 2 == 0:
        return Int32Array.frombuffer(np.asarray(values, np.int32).tobytes(), [2, len(values) // 2])
    if draw(st.integers(0, 19)) == 0:  # more tokens than any receiver takes; out of band
        return Int32Array(np.full(1_100_000, draw(_token_values), np.int32))
    return Int32Array(values)


@st.composite
def float32_arrays(draw: st.DrawFn) -> Float32Array:
    values = draw(st.lists(st.floats(width=32), max_size=40))
    return Float32Array(values)


segments = st.lists(st.builds(wire.Segment, hostile_ints, hostile_ints), max_size=4)

prompts = st.builds(wire.Prompt, hostile_text, hostile_text, hostile_ids, hostile_text, hostile_text,
                    hostile_ints)

turns = st.builds(wire.Turn, int32_arrays(), int32_arrays(), float32_arrays(), hostile_ints,
                  hostile_text, hostile_text, segments)


# More turns than any receiver takes (Limits.max_items), each tiny: ~2 MB on the wire.
_MANY_TURNS = [wire.Turn(Int32Array([1]), Int32Array([2]), Float32Array([-0.5]), 0, "", "")] * 70_000


def trajectories(trajectory_id: st.SearchStrategy[str] = hostile_ids) -> st.SearchStrategy[wire.Trajectory]:
    return st.builds(
        wire.Trajectory, trajectory_id, hostile_ints, hostile_ids, hostile_text,
        st.one_of(st.lists(turns, max_size=3), st.just([]), st.just(_MANY_TURNS)),
        hostile_floats,
        st.dictionaries(hostile_text, hostile_text, max_size=3),
        st.one_of(st.just(""), hostile_text),
        st.one_of(st.none(), prompts))


def scored(trajectory_id: st.SearchStrategy[str] = hostile_ids) -> st.SearchStrategy[wire.ScoredTrajectory]:
    return st.builds(wire.ScoredTrajectory, trajectories(trajectory_id), hostile_floats,
                     st.one_of(st.just(""), hostile_text))


generate_requests = st.builds(
    wire.GenerateRequest, hostile_ids, hostile_ids, int32_arrays(), hostile_ints, hostile_floats,
    hostile_floats, st.one_of(st.none(), hostile_ints), st.one_of(st.none(), hostile_ints),
    hostile_ints)

generate_results = st.builds(
    wire.GenerateResult, hostile_ids, int32_arrays(), float32_arrays(), hostile_ints,
    st.sampled_from(["stop", "length", "abort", "error", "version"]), hostile_text, segments,
    hostile_ids, hostile_floats)

aborts = st.builds(wire.Abort, hostile_ids)

rollout_stats = st.builds(wire.RolloutStats, hostile_ints, hostile_ints, hostile_ints, hostile_ints,
                          hostile_ints, hostile_floats, hostile_ids, hostile_floats)

repack_orders = st.builds(
    wire.RepackOrder, hostile_ids, hostile_ids, hostile_ids,
    st.one_of(st.lists(hostile_ids, max_size=5), st.just([""] * 100_000)))

acks = st.builds(wire.Ack, st.one_of(st.lists(hostile_ids, max_size=5), st.just(["x"] * 100_000)),
                 st.booleans(), hostile_text)

# What a rollout's requests socket accepts.
rollout_requests = st.one_of(generate_requests, aborts, rollout_stats, repack_orders)
