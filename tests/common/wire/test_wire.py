"""The data-plane codec: round trips, array framing, and hostile input."""

from __future__ import annotations

import pickle
import random
import struct

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlfleet.common.wire import messages as wire
from rlfleet.common.wire.arrays import Float32Array, Int32Array
from rlfleet.common.wire.messages import (
    INLINE_MAX_BYTES,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    REJECT_REASONS,
    Abort,
    Ack,
    GenerateRequest,
    GenerateResult,
    MessageType,
    Prompt,
    RepackOrder,
    RolloutStats,
    ScoredTrajectory,
    Trajectory,
    Turn,
    WireError,
    decode,
    encode,
)

BIG = 5000  # elements: 20 kB, above INLINE_MAX_BYTES -> out-of-band frame


def _turn(n: int, v: int = 3) -> Turn:
    return Turn(
        prompt_token_ids=Int32Array(range(n)),
        token_ids=Int32Array([-(2**31), 2**31 - 1, 0, 7]),
        logprobs=Float32Array([-0.5, -1.25, 0.0, -3.0]),
        weight_version=v,
        observation="obs ✓",
        action="act",
    )


def _trajectory(n: int = 10) -> Trajectory:
    return Trajectory(
        trajectory_id="t-1",
        prompt_id=42,
        group_id="g-1",
        task="arithmetic",
        turns=[_turn(n), _turn(3, v=4)],
        env_reward=1.0,
        info={"k": "v"},
        prompt=Prompt("arithmetic", "train", "arithmetic-train-0-7-ab12cd34", "37+85", "122", 5),
    )


def all_messages(n: int = 10) -> list[wire.Message]:
    return [
        GenerateRequest("r1", "t1", Int32Array(range(n)), 16, 0.7, 0.95, seed=None),
        GenerateRequest("r2", "t1", Int32Array([]), 1, 1.0, 1.0, seed=1234),
        GenerateResult("r1", Int32Array(range(n)), Float32Array([-0.25] * n), 7, "length"),
        GenerateResult("r3", Int32Array([]), Float32Array([]), 7, "error", error="CUDA OOM"),
        Abort("r1"),
        _trajectory(n),
        ScoredTrajectory(_trajectory(n), reward=0.5, reward_error=""),
        RolloutStats(3, 12, 4, 1000, 4096, 1234.5, rollout_id="ro-1", time=1.7e9),
        RepackOrder("o1", "ro-1", "ro-2", ["r1", "r2"]),
        Ack(["t-1", "t-2"], ok=False, error="staleness"),
    ]


def test_every_message_type_is_covered() -> None:
    assert {type(m) for m in all_messages()} == set(MESSAGE_TYPES.values())
    assert len({int(t) for t in MessageType}) == len(MessageType)
    assert PROTOCOL_VERSION == 1


@pytest.mark.parametrize("n", [10, BIG], ids=["inline", "out-of-band"])
def test_round_trip_every_type(n: int) -> None:
    for msg in all_messages(n):
        frames = encode(msg)
        got = decode(frames)
        assert got == msg and type(got) is type(msg)


def test_array_framing_inline_vs_out_of_band() -> None:
    small = GenerateResult("r", Int32Array(range(10)), Float32Array([0.5] * 10), 1, "stop")
    assert len(encode(small)) == 2  # header + body, arrays inline
    big = GenerateResult("r", Int32Array(range(BIG)), Float32Array([0.5] * 10), 1, "stop")
    frames = encode(big)
    assert len(frames) == 3  # only the big array went out of band
    assert bytes(frames[2]) == struct.pack(f"<{BIG}i", *range(BIG))  # raw little-endian
    got = decode(frames)
    assert got.token_ids.dtype == "<i4" and got.logprobs.dtype == "<f4"
    assert got.token_ids.tolist() == list(range(BIG))
    assert got.token_ids.shape == (BIG,)
    # Out-of-band arrays are views of the received frame, not copies.
    assert got.token_ids.data.obj is frames[2].obj


def test_threshold_is_a_parameter() -> None:
    msg = Abort("x")
    assert len(encode(msg)) == 2
    req = GenerateRequest("r", "t", Int32Array(range(4)), 1, 1.0, 1.0)
    assert len(encode(req, inline_max=0)) == 3
    assert INLINE_MAX_BYTES >= 1024


def test_float32_rounding_and_values() -> None:
    a = Float32Array([0.1, -1e30, float("inf")])
    got = decode(encode(GenerateResult("r", Int32Array([1, 2, 3]), a, 0, "stop"))).logprobs
    assert got == a
    assert got.tolist()[1:] == [pytest.approx(-1e30, rel=1e-6), float("inf")]


def test_array_constructors() -> None:
    assert Int32Array.frombuffer(struct.pack("<3i", 1, 2, 3)).tolist() == [1, 2, 3]
    with pytest.raises(ValueError):
        Int32Array.frombuffer(b"12345")
    with pytest.raises(TypeError):
        Int32Array(b"\x01\x02")  # raw bytes are ambiguous: frombuffer() says what they are
    with pytest.raises(TypeError):
        Int32Array(Float32Array([1.0]))
    with pytest.raises(OverflowError):
        Int32Array([2**31])
    assert len(Int32Array(range(5))) == 5 and Int32Array([]).size == 0


def test_wrong_field_types_are_refused_at_the_sender() -> None:
    with pytest.raises(TypeError, match="Int32Array"):
        GenerateRequest("r", "t", [1, 2, 3], 1, 1.0, 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Float32Array"):
        GenerateResult("r", Int32Array([1]), Int32Array([1]), 1, "stop")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        encode({"not": "a message"})  # type: ignore[arg-type]


def test_expect_filters_types() -> None:
    frames = encode(Abort("r"))
    assert decode(frames, expect=(Abort, Ack)) == Abort("r")
    with pytest.raises(WireError) as e:
        decode(frames, expect=GenerateRequest)
    assert e.value.reason == "unexpected_type"


def _reason(frames: list) -> str:
    with pytest.raises(WireError) as e:
        decode(frames)
    assert e.value.reason in REJECT_REASONS
    return e.value.reason


def _header(*items: object) -> bytes:
    return msgspec.msgpack.encode(list(items))


def test_rejection_reasons() -> None:
    msg = GenerateResult("r", Int32Array(range(BIG)), Float32Array([0.5]), 1, "stop")
    header, body, buf = encode(msg)
    tid = int(MessageType.GENERATE_RESULT)
    assert _reason([]) == "truncated"
    assert _reason([header]) == "truncated"
    assert _reason([header, body]) == "truncated"  # buffer frame missing
    assert _reason([header, body[:-3], buf]) == "truncated"
    assert _reason([header, body, buf, b"extra"]) == "malformed"
    assert _reason([_header(2, tid, 1), body, buf]) == "bad_version"
    assert _reason([_header(0), body, buf]) == "bad_version"
    assert _reason([_header(1, 99, 1), body, buf]) == "unknown_type"
    assert _reason([_header(1, int(MessageType.ABORT), 1), body, buf]) == "malformed"
    assert _reason([_header("1", tid, 1), body, buf]) == "malformed"
    assert _reason([_header(True, tid, 1), body, buf]) == "malformed"
    assert _reason([b"\xc1", body]) == "malformed"  # 0xc1: never used in msgpack
    assert _reason([header, body, buf[:-1]]) == "bad_array"  # shape says 5000 items
    with pytest.raises(WireError) as e:
        decode([header, body, buf], max_bytes=1000)
    assert e.value.reason == "oversized" and isinstance(e.value, ValueError)


def test_arrays_are_allow_listed() -> None:
    gen = int(MessageType.GENERATE_REQUEST)

    def req(arr: object, n_buffers: int = 0) -> list:
        body = msgspec.msgpack.encode(["r", "t", arr, 1, 1.0, 1.0, None])
        return [_header(1, gen, n_buffers), body]

    ok = ["<i4", [2], struct.pack("<2i", 5, 6)]
    assert decode(req(ok)).prompt_token_ids.tolist() == [5, 6]
    for dtype in ["<f4", ">i4", "<i8", "O", "|O", "<U1", 7]:
        assert _reason(req([dtype, [2], b"\0" * 8])) == "bad_array"
    assert _reason(req(["<i4", [3], b"\0" * 8])) == "bad_array"  # shape vs bytes
    assert _reason(req(["<i4", [-2], b"\0" * 8])) == "bad_array"
    assert _reason(req(["<i4", [2**62, 2**62], b""])) == "bad_array"  # huge shape claim
    assert _reason(req(["<i4", [2], 0])) == "bad_array"  # index to a frame that isn't there
    assert _reason(req(["<i4", [2], [1, 2]])) == "bad_array"  # msgpack list, not bytes
    assert _reason(req(["<i4", [2]])) == "bad_array"
    assert _reason(req([1, 2, 3, 4, 5, 6, 7, 8])) == "bad_array"
    # The same buffer referenced twice would alias two arrays to one frame.
    body = msgspec.msgpack.encode(["r", ["<i4", [2], 0], ["<f4", [2], 0], 0, "stop"])
    res = int(MessageType.GENERATE_RESULT)
    assert _reason([_header(1, res, 1), body, b"\0" * 8]) == "bad_array"


def test_pickle_is_refused() -> None:
    msg = GenerateRequest("r", "t", Int32Array([1, 2]), 1, 1.0, 1.0)
    header = encode(msg)[0]
    for proto in (2, pickle.HIGHEST_PROTOCOL):
        payload = pickle.dumps(msg.__class__, protocol=proto)
        with pytest.raises(WireError):
            decode([header, payload])
        with pytest.raises(WireError):
            decode([payload])
        with pytest.raises(WireError):
            decode([payload, payload])
    with pytest.raises(TypeError):  # Arrays themselves do not pickle either
        pickle.dumps(Int32Array([1]))


def test_non_bytes_frames_are_malformed() -> None:
    assert _reason(["a str", "b"]) == "malformed"
    assert _reason([None, None]) == "malformed"


def _mutations(frames: list[bytes], rng: random.Random) -> list[bytes]:
    frames = [bytes(f) for f in frames]
    op = rng.randrange(7)
    i = rng.randrange(len(frames))
    f = bytearray(frames[i])
    if op == 0 and f:  # truncate
        frames[i] = bytes(f[: rng.randrange(len(f))])
    elif op == 1 and f:  # flip bytes
        for _ in range(rng.randint(1, 4)):
            f[rng.randrange(len(f))] ^= 1 << rng.randrange(8)
        frames[i] = bytes(f)
    elif op == 2:  # append a frame
        frames.append(rng.randbytes(rng.randrange(16)))
    elif op == 3:  # drop a frame
        del frames[i]
    elif op == 4:  # huge length claim: bin32/array32/str32 marker with 4 GiB size
        marker = rng.choice([b"\xc6", b"\xdd", b"\xdb", b"\xdf"])
        frames[i] = bytes(f[: rng.randrange(len(f) + 1)]) + marker + b"\xff\xff\xff\xff"
    elif op == 5:  # random version / type id
        frames[0] = _header(rng.randrange(-5, 5), rng.randrange(-5, 20), rng.randrange(4))
    else:  # splice random bytes in
        pos = rng.randrange(len(f) + 1)
        frames[i] = bytes(f[:pos]) + rng.randbytes(rng.randrange(1, 8)) + bytes(f[pos:])
    return frames


def test_seeded_mutation_fuzz_only_raises_wire_error() -> None:
    rng = random.Random(1234)
    corpus = [encode(m) for m in all_messages(10) + all_messages(BIG)[:3]]
    outcomes: dict[str, int] = {}
    for _ in range(4000):
        frames = _mutations(rng.choice(corpus), rng)
        try:
            decode(frames)
            outcomes["ok"] = outcomes.get("ok", 0) + 1
        except WireError as e:
            assert e.reason in REJECT_REASONS
            outcomes[e.reason] = outcomes.get(e.reason, 0) + 1
    # The fuzz reaches the interesting branches, not just the first check.
    for reason in ("truncated", "malformed", "bad_version", "unknown_type", "bad_array"):
        assert outcomes.get(reason, 0) > 0, outcomes


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_hypothesis_random_frames(frames: list[bytes]) -> None:
    try:
        decode(frames)
    except WireError as e:
        assert e.reason in REJECT_REASONS


@settings(max_examples=200, deadline=None, database=None)
@given(
    version=st.sampled_from([1, 1, 1, 0, 2]),  # mostly the real version: reach the body
    tid=st.integers(0, 9),
    n=st.integers(0, 2),
    body=st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats()
        | st.text(max_size=8) | st.binary(max_size=16),
        lambda inner: st.lists(inner, max_size=8)
        | st.dictionaries(st.text(max_size=4), inner, max_size=4),
        max_leaves=30,
    ),
    extra=st.lists(st.binary(max_size=32), max_size=3),
)
def test_hypothesis_well_formed_msgpack_wrong_shapes(
    version: int, tid: int, n: int, body: object, extra: list[bytes]
) -> None:
    frames = [_header(version, tid, n), msgspec.msgpack.encode(body), *extra]
    try:
        decode(frames)
    except WireError as e:
        assert e.reason in REJECT_REASONS


def test_record_rejection_counts_and_rate_limits_logs(caplog: pytest.LogCaptureFixture) -> None:
    counter = wire.REJECTED_FRAMES.labels(reason="bad_version")
    before = counter._value.get()
    counts: dict[str, int] = {}
    wire._log_state.clear()
    with caplog.at_level("WARNING", logger="rlfleet.wire"):
        for _ in range(50):
            wire.record_rejection(WireError("bad_version", "v9"), "test", counts)
    assert counts == {"bad_version": 50}
    assert counter._value.get() - before == 50
    assert len([r for r in caplog.records if r.name == "rlfleet.wire"]) == 1


def test_numpy_interop() -> None:
    np = pytest.importorskip("numpy")
    a = Int32Array(np.arange(10, dtype=np.int64))
    assert a.tolist() == list(range(10)) and a.numpy().dtype == np.int32
    with pytest.raises(OverflowError):
        Int32Array(np.array([2**40]))
    with pytest.raises(TypeError):
        Int32Array(np.array([1.5]))  # float -> int would truncate silently
    big = Float32Array(np.linspace(0, 1, BIG))
    got = decode(encode(GenerateResult("r", a, big, 1, "stop"))).logprobs.numpy()
    assert got.dtype == np.float32 and np.array_equal(got, big.numpy())
    assert not got.flags.writeable
    assert Float32Array(np.ones((2, 3))).shape == (2, 3)


def test_appending_a_defaulted_field_stays_compatible() -> None:
    # The rule in wire.py's docstring: a newer sender's extra trailing field is ignored,
    # an older sender's missing trailing (defaulted) field takes its default.
    abort = int(MessageType.ABORT)
    assert decode([_header(1, abort, 0), msgspec.msgpack.encode(["r", "from v1.1"])]) == Abort("r")
    res = int(MessageType.GENERATE_RESULT)
    old = ["r", ["<i4", [0], b""], ["<f4", [0], b""], 3, "stop"]  # no `error` field
    got = decode([_header(1, res, 0), msgspec.msgpack.encode(old)])
    assert isinstance(got, GenerateResult) and got.error == ""
    # A missing required field is not compatible.
    assert _reason([_header(1, res, 0), msgspec.msgpack.encode(old[:3])]) == "malformed"


def test_the_prompt_travels_typed_inside_the_trajectory() -> None:
    traj = _trajectory()
    got = decode(encode(ScoredTrajectory(traj, 1.0)))
    assert type(got.trajectory.prompt) is Prompt and got.trajectory.prompt == traj.prompt
    assert got.trajectory.info == {"k": "v"}  # not in info any more
    assert Prompt.from_dict(traj.prompt.to_dict()) == traj.prompt  # JSON for datasets, reports
    # A sender that predates the field: decodes, with no prompt (the reward-host scores 0).
    tid = int(MessageType.TRAJECTORY)
    body = msgspec.msgpack.decode(encode(traj)[1])
    old = decode([_header(1, tid, 0), msgspec.msgpack.encode(body[:-1])])
    assert isinstance(old, Trajectory) and old.prompt is None and old.turns == traj.turns


@pytest.mark.parametrize("bad", [
    "37+85",                                                # not a prompt at all
    ["arithmetic", "train", "uid", "37+85"],                # answer missing
    ["arithmetic", "train", "uid", "37+85", "122", "5"],   # seed not an int
    {"task": "arithmetic"},                                 # a map where a prompt is positional
])
def test_a_malformed_prompt_rejects_the_message_and_is_counted(bad: object) -> None:
    tid = int(MessageType.TRAJECTORY)
    body = msgspec.msgpack.decode(encode(_trajectory())[1])
    body[-1] = bad
    counter = wire.REJECTED_FRAMES.labels(reason="malformed")
    before = counter._value.get()
    with pytest.raises(WireError) as e:
        decode([_header(1, tid, 0), msgspec.msgpack.encode(body)])
    wire.record_rejection(e.value, "test")
    assert e.value.reason == "malformed" and counter._value.get() - before == 1
