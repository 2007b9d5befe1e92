"""Data-plane messages and the one codec that puts them on the wire.

Every message that crosses a ZeroMQ socket is declared here (STYLE 6-7). A message
travels as a multipart ZeroMQ message::

    [header, body, *buffers]
    header  = msgpack [PROTOCOL_VERSION, type_id, n_buffers]
    body    = msgpack of the Struct, array_like (fields by position, no names)
    buffers = raw little-endian bytes of arrays larger than ``inline_max``

An array is encoded in the body as ``[dtype, shape, data]`` where ``data`` is either
msgpack bin (small arrays, inline) or an int indexing ``buffers`` (large arrays,
sent and received zero-copy). Only little-endian int32 and float32 are accepted.
Pickle is never used; a frame that is not this format is rejected with WireError.

Compatibility rule: within one PROTOCOL_VERSION a field may only be *appended* with
a default (older decoders ignore trailing fields, newer ones fill the default).
Anything else (removing, reordering, retyping a field) bumps PROTOCOL_VERSION.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
from prometheus_client import Counter

from rlfleet.common import metrics
from rlfleet.common.wire.arrays import ARRAY_TYPES, Array, Float32Array, Int32Array

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 256 * 1024 * 1024
# Arrays above this go out-of-band as their own frame (no copy into the body).
INLINE_MAX_BYTES = 4096
_MAX_HEADER_BYTES = 64
_MAX_NDIM = 8

log = logging.getLogger("rlfleet.wire")

REJECT_REASONS = (
    "truncated",
    "oversized",
    "bad_version",
    "unknown_type",
    "malformed",
    "unexpected_type",
    "bad_array",
)
# Decodable but hostile (validation.py), and a handler that raised on the message.
CONTENT_REASONS = ("out_of_range", "not_finite", "too_large", "bad_id", "out_of_vocab",
                   "inconsistent")
HANDLER_ERROR = "handler_error"
REJECT_REASONS += CONTENT_REASONS

REJECTED_FRAMES = Counter(
    "rlfleet_wire_rejected_frames_total",
    "Data-plane messages rejected by a receiver, by reason",
    ["reason"],
)
for _r in REJECT_REASONS:  # export zeros so dashboards and alerts see every series
    REJECTED_FRAMES.labels(reason=_r)


class WireError(ValueError):
    """A message could not be decoded. ``reason`` is one of REJECT_REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in REJECT_REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


# Arrays (Array, Int32Array, Float32Array) live in common/wire/arrays.py; imported above so
# every message type and its field types come from this one module.


def _require_arrays(msg: msgspec.Struct, **fields: type[Array]) -> None:
    # Catches a list or ndarray passed where an Array belongs at the sender, with a
    # message, instead of as a confusing rejection at the receiver.
    for name, cls in fields.items():
        value = getattr(msg, name)
        if type(value) is not cls:
            raise TypeError(
                f"{type(msg).__name__}.{name} must be {cls.__name__}, got "
                f"{type(value).__name__} (wrap it: {cls.__name__}(values))"
            )


# ----------------------------------------------------------------------------- messages


class _Msg(msgspec.Struct, frozen=True, array_like=True):
    pass


class GenerateRequest(_Msg):
    """env-host -> rollout: generate one turn."""

    request_id: str
    trajectory_id: str
    prompt_token_ids: Int32Array
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None = None
    # Continuation of an interrupted generation (ARCHITECTURE §4): serve it only with
    # exactly this weight version; a rollout that does not hold it answers at once with
    # finish_reason "version" instead of mixing versions within the turn.
    required_version: int | None = None
    # The last prefix_tokens of the prompt are this turn's own earlier tokens (a
    # continuation after an abort or a repack): the same generation goes on from there.
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        _require_arrays(self, prompt_token_ids=Int32Array)


# "version": the request required a weight version this rollout does not hold.
FinishReason = Literal["stop", "length", "abort", "error", "version"]


class Segment(msgspec.Struct, frozen=True, array_like=True):
    """A run of consecutive generated tokens made by one weight version."""

    tokens: int
    version: int


class GenerateResult(_Msg):
    """rollout -> env-host. A failed generation is a result with finish_reason="error"."""

    request_id: str
    token_ids: Int32Array
    logprobs: Float32Array
    weight_version: int
    finish_reason: FinishReason
    error: str = ""
    # When more than one run of tokens made this result (continuations; versions mix
    # only in the `partial` mode): their lengths and versions, in order. Empty: all
    # tokens are one segment of weight_version.
    segments: list[Segment] = msgspec.field(default_factory=list)
    # On an abort ordered by a repack: the rollout (same version) to continue on.
    continue_on: str = ""
    # Seconds from the request's arrival at the rollout to its first token (queue + prefill).
    first_token_s: float = 0.0

    def __post_init__(self) -> None:
        _require_arrays(self, token_ids=Int32Array, logprobs=Float32Array)


class Abort(_Msg):
    """env-host -> rollout: stop generating this request (between engine steps)."""

    request_id: str


class Turn(msgspec.Struct, frozen=True, array_like=True):
    """One generated segment of a trajectory, with the weight version that made it."""

    prompt_token_ids: Int32Array
    token_ids: Int32Array
    logprobs: Float32Array
    weight_version: int  # the oldest segment's version when there are several
    observation: str
    action: str
    segments: list[Segment] = msgspec.field(default_factory=list)  # as GenerateResult.segments

    def __post_init__(self) -> None:
        _require_arrays(
            self, prompt_token_ids=Int32Array, token_ids=Int32Array, logprobs=Float32Array
        )


class Prompt(msgspec.Struct, frozen=True, array_like=True):
    """One task instance (made by ``rlfleet.daemons.tasks``). It travels, as this one
    type, from the env-host's prompt stream in a Trajectory to the reward-host and on
    to its reward workers, so scoring needs no prompt stream of its own."""

    task: str       # task name, as given to get_task
    split: str      # "train" or "eval"
    uid: str        # unique per generated prompt: task-split-seed-index-contentdigest
    question: str   # arithmetic: "37+85"; frozenlake: the map rows joined by "\n"
    answer: str     # arithmetic: "122"; frozenlake: "" (the env decides success)
    seed: int = 0   # generator seed of this instance (frozenlake: the map seed)

    def to_dict(self) -> dict[str, Any]:
        """Plain fields, for JSON outside the data plane (datasets, reports)."""
        return msgspec.structs.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Prompt:
        return cls(**{name: d[name] for name in cls.__struct_fields__ if name in d})


class Trajectory(_Msg):
    """env-host -> reward-host. ``dropped_reason`` non-empty means: account, don't train.
    ``prompt``: what the reward-host scores against (None only from a sender that
    predates the field; such a trajectory is scored 0 with a reward_error)."""

    trajectory_id: str
    prompt_id: int
    group_id: str
    task: str
    turns: list[Turn]
    env_reward: float
    info: dict[str, str] = msgspec.field(default_factory=dict)
    dropped_reason: str = ""
    prompt: Prompt | None = None


class ScoredTrajectory(_Msg):
    """reward-host -> trainer."""

    trajectory: Trajectory
    reward: float
    reward_error: str = ""


class EngineStats(msgspec.Struct, frozen=True, array_like=True):
    """An engine's load (daemons/rollout/engines/api.py ``Engine.stats``); not a message
    itself, the first fields of RolloutStats. KV figures are in tokens held in the cache."""

    weight_version: int
    running: int
    waiting: int
    kv_used: int
    kv_total: int
    tokens_per_s: float


class RolloutStats(EngineStats, _Msg):
    """rollout -> repack-manager, periodically: its engine's stats, then who and when
    (``time``: the sender's unix time)."""

    rollout_id: str
    time: float

    @classmethod
    def poll(cls, rollout_id: str = "") -> RolloutStats:
        """The request of a stats poll: a RolloutStats with nothing measured in it."""
        return cls(0, 0, 0, 0, 0, 0.0, rollout_id, 0.0)


class RepackOrder(_Msg):
    """repack-manager -> rollout: move these requests to another rollout."""

    order_id: str
    source_rollout: str
    target_rollout: str
    request_ids: list[str]


class Ack(_Msg):
    """Receipt for ids (trajectory ids, order ids). ok=False: rejected for good."""

    ids: list[str]
    ok: bool
    error: str = ""


class MessageType(enum.IntEnum):
    """Stable wire ids. Never renumber; append."""

    GENERATE_REQUEST = 1
    GENERATE_RESULT = 2
    ABORT = 3
    TRAJECTORY = 4
    SCORED_TRAJECTORY = 5
    ROLLOUT_STATS = 6
    REPACK_ORDER = 7
    ACK = 8


Message = (GenerateRequest | GenerateResult | Abort | Trajectory | ScoredTrajectory | RolloutStats | RepackOrder
           | Ack)

MESSAGE_TYPES: dict[MessageType, type[_Msg]] = {
    MessageType.GENERATE_REQUEST: GenerateRequest,
    MessageType.GENERATE_RESULT: GenerateResult,
    MessageType.ABORT: Abort,
    MessageType.TRAJECTORY: Trajectory,
    MessageType.SCORED_TRAJECTORY: ScoredTrajectory,
    MessageType.ROLLOUT_STATS: RolloutStats,
    MessageType.REPACK_ORDER: RepackOrder,
    MessageType.ACK: Ack,
}
TYPE_IDS: dict[type, MessageType] = {cls: tid for tid, cls in MESSAGE_TYPES.items()}

# ----------------------------------------------------------------------------- codec


class _BadArray(Exception):
    # Not a ValueError on purpose: msgspec re-wraps ValueError/TypeError raised in
    # hooks as ValidationError, and we want to keep the reason "bad_array".
    pass


class _Codec(threading.local):
    """Per-thread encoder/decoders plus the out-of-band buffers of the current call."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self.header_decoder = msgspec.msgpack.Decoder(list)
        self.decoders = {
            tid: msgspec.msgpack.Decoder(cls, dec_hook=self._dec_hook)
            for tid, cls in MESSAGE_TYPES.items()
        }
        self.out: list[memoryview] = []
        self.inline_max = INLINE_MAX_BYTES
        self.frames: Sequence[memoryview] = ()
        self.used: set[int] = set()

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, Array):
            if obj.nbytes <= self.inline_max:
                return (obj.dtype, obj.shape, obj.data)
            self.out.append(obj.data)
            return (obj.dtype, obj.shape, len(self.out) - 1)
        raise TypeError(f"cannot encode {type(obj).__name__} on the wire")

    def _dec_hook(self, typ: type, obj: Any) -> Any:
        if not (isinstance(typ, type) and issubclass(typ, Array)):
            raise _BadArray(f"no decoder for {typ}")
        if not isinstance(obj, list) or len(obj) != 3:
            raise _BadArray("array must be [dtype, shape, data]")
        dtype, shape, data = obj
        if ARRAY_TYPES.get(dtype) is not typ:
            raise _BadArray(f"dtype {dtype!r} where {typ.dtype} expected")
        if (
            not isinstance(shape, list)
            or len(shape) > _MAX_NDIM
            or not all(type(d) is int and d >= 0 for d in shape)
        ):
            raise _BadArray(f"bad shape {shape!r}")
        if type(data) is int:
            if not 0 <= data < len(self.frames) or data in self.used:
                raise _BadArray(f"bad buffer index {data}")
            self.used.add(data)
            data = self.frames[data]
        elif not isinstance(data, bytes):
            raise _BadArray("array data must be bin or a buffer index")
        if math.prod(shape) * typ.itemsize != len(data):
            raise _BadArray(f"shape {shape} does not match {len(data)} bytes of {dtype}")
        return typ.frombuffer(data, shape)


_codec = _Codec()


def encode(msg: Message, *, inline_max: int = INLINE_MAX_BYTES) -> list[bytes | memoryview]:
    """Frames for one message: ``[header, body, *buffers]``.

    Buffers are views of the arrays' memory (zero-copy): keep the message unmodified
    until the frames are sent (send with ``copy=False`` is fine: zmq holds a reference).
    """
    tid = TYPE_IDS.get(type(msg))
    if tid is None:
        raise TypeError(f"{type(msg).__name__} is not a wire message")
    c = _codec
    c.out, c.inline_max = [], inline_max
    try:
        body = c.encoder.encode(msg)
        out = c.out
    finally:
        c.out = []
    header = c.encoder.encode((PROTOCOL_VERSION, int(tid), len(out)))
    return [header, body, *out]


def _decode_reason(e: msgspec.DecodeError) -> str:
    return "truncated" if "truncated" in str(e) else "malformed"


def _as_view(frame: Any) -> memoryview:
    if isinstance(frame, memoryview):
        return frame.cast("B") if frame.format != "B" or frame.ndim != 1 else frame
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    return memoryview(buf if buf is not None else frame).cast("B")


def decode(
    frames: Sequence[Any],
    expect: type | tuple[type, ...] | None = None,
    *,
    max_bytes: int = MAX_FRAME_BYTES,
) -> Message:
    """Decode ``[header, body, *buffers]`` (bytes, memoryviews or zmq.Frames).

    Raises WireError and nothing else on any bad input. Large arrays of the result
    are views into the given frames (no copy).
    """
    try:
        views = [_as_view(f) for f in frames]
    except (TypeError, ValueError) as e:
        raise WireError("malformed", f"frame is not bytes-like: {e}") from None
    if len(views) < 2:
        raise WireError("truncated", f"{len(views)} frame(s), need header and body")
    for v in views:
        if v.nbytes > max_bytes:
            raise WireError("oversized", f"frame of {v.nbytes} bytes > {max_bytes}")
    c = _codec
    if views[0].nbytes > _MAX_HEADER_BYTES:
        raise WireError("malformed", "header too long")
    try:
        header = c.header_decoder.decode(views[0])
    except msgspec.DecodeError as e:
        raise WireError(_decode_reason(e), f"header: {e}") from None
    except Exception as e:  # ValidationError (not a list), RecursionError ...
        raise WireError("malformed", f"header: {e}") from None
    if not header or type(header[0]) is not int:
        raise WireError("malformed", "header has no version")
    if header[0] != PROTOCOL_VERSION:
        raise WireError("bad_version", f"got {header[0]!r}, this side speaks {PROTOCOL_VERSION}")
    if len(header) != 3 or type(header[1]) is not int or type(header[2]) is not int:
        raise WireError("malformed", f"header {header!r}")
    _, tid, n_buffers = header
    decoder = c.decoders.get(tid)  # type: ignore[call-overload]
    if decoder is None:
        raise WireError("unknown_type", f"type id {tid}")
    cls = MESSAGE_TYPES[MessageType(tid)]
    if expect is not None and not issubclass(cls, expect):
        raise WireError("unexpected_type", f"got {cls.__name__}")
    if len(views) - 2 < n_buffers:
        raise WireError("truncated", f"{len(views) - 2} buffer frames, header says {n_buffers}")
    if len(views) - 2 > n_buffers:
        raise WireError("malformed", f"{len(views) - 2} buffer frames, header says {n_buffers}")
    c.frames, c.used = views[2:], set()
    try:
        msg = decoder.decode(views[1])
        if len(c.used) != n_buffers:
            raise WireError("malformed", f"{n_buffers - len(c.used)} buffer(s) not referenced")
        return msg  # type: ignore[no-any-return]
    except WireError:
        raise
    except _BadArray as e:
        raise WireError("bad_array", str(e)) from None
    except msgspec.DecodeError as e:
        raise WireError(_decode_reason(e), str(e)) from None
    except Exception as e:  # ValidationError, RecursionError, anything from hostile input
        raise WireError("malformed", f"{type(e).__name__}: {e}") from None
    finally:
        c.frames, c.used = (), set()


# ----------------------------------------------------------------------------- rejections

_LOG_EVERY_S = 600.0  # after the first, one summary line per (endpoint, kind) at most this often
_log_state: dict[tuple[str, str], tuple[float, int]] = {}  # -> (last logged, suppressed since)
_log_lock = threading.Lock()


def count_rejection(where: str, kind: str) -> None:
    """Count one rejected message in rlfleet_rejected_messages_total{role,endpoint,kind}."""
    metrics.REJECTED_MESSAGES.labels(role=metrics.process_role(), endpoint=where, kind=kind).inc()


def record_rejection(err: WireError, where: str, counts: dict[str, int] | None = None) -> None:
    """Count and log one rejected message; what every receiver does on WireError.

    Logged once per (endpoint, reason), then as a count at most every _LOG_EVERY_S: a
    peer spraying garbage cannot flood the log (or fill the disk with its payloads);
    the Counters stay exact.
    """
    REJECTED_FRAMES.labels(reason=err.reason).inc()
    count_rejection(where, err.reason)
    if counts is not None:
        counts[err.reason] = counts.get(err.reason, 0) + 1
    now = time.monotonic()
    key = (where, err.reason)
    with _log_lock:
        last, suppressed = _log_state.get(key, (-math.inf, 0))
        if now - last < _LOG_EVERY_S:
            _log_state[key] = (last, suppressed + 1)
            return
        _log_state[key] = (now, 0)
    more = f" (+{suppressed} more since last report)" if suppressed else ""
    log.warning("%s: rejected message: %s%s", where, str(err)[:500], more,
                extra={"reason": err.reason, "where": where, "suppressed": suppressed})
