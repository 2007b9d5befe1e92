"""What a decodable message must also be before a daemon touches it, and what a daemon
does with one that is not — or with one its own handler chokes on.

``decode`` (wire.py) guarantees the *shape*: the right fields with the right types.
Within those types a peer can still send values no legitimate sender makes and no
receiver should carry further: ints beyond int64 (msgpack carries up to 2**64-1; numpy,
torch and most stores stop at 2**63-1), NaN and infinities, megabyte "ids", token ids
below 0 or past the receiver's vocabulary, arrays whose lengths disagree, a million
list items. ``check_message`` walks a decoded message and raises ``WireError`` with one
of ``CONTENT_REASONS`` for the first such value, so every receiver rejects it on the
path it already has for undecodable frames (sockets.py ``_Endpoint._decode``):
counted, logged once per kind, and, where the protocol has one, answered with the
refusal ``error_reply`` makes (an error GenerateResult, a negative Ack) instead of
silence.

Deliberately left to the handlers, which account for them: what a *legitimate* but
broken peer may send and what decides bookkeeping — a NaN reward (the trainer drops
the group, durably), log-probs that are not finite, a rollout's garbage result (the
env-host retries the turn elsewhere), impossible stats (the repack-manager's own
checks). A rejection here is for good, so it must only catch what is never data.

``confined`` is the other half: an exception raised while handling *one* message is
that message's failure — counted as ``handler_error``, logged with its traceback once
per exception type — never the daemon's.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from rlfleet.common.wire.arrays import Array, Float32Array, Int32Array
from rlfleet.common.wire.messages import (
    Abort,
    Ack,
    GenerateRequest,
    GenerateResult,
    Prompt,
    RepackOrder,
    RolloutStats,
    ScoredTrajectory,
    Segment,
    Trajectory,
    Turn,
    WireError,
    count_rejection,
)

log = logging.getLogger("rlfleet.wire")

I64_MIN, I64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Limits:
    """Bounds one receiving endpoint enforces. ``vocab_size``: token ids must lie in
    [0, vocab_size) (None: only >= 0; a receiver that knows its model sets it)."""

    max_id_chars: int = 256  # request, trajectory, group, order and rollout ids
    max_text_chars: int = 1 << 20  # any other string (observations, actions, prompts)
    max_items: int = 65_536  # any list or dict (turns, segments, ids, info)
    max_tokens: int = 1 << 20  # any array
    vocab_size: int | None = None


DEFAULT_LIMITS = Limits()

# Fields holding an id: non-empty (where marked), printable ASCII, at most max_id_chars.
_IDS: dict[type, dict[str, bool]] = {  # field -> may be empty
    GenerateRequest: {"request_id": False, "trajectory_id": True},
    GenerateResult: {"request_id": False, "continue_on": True},
    Abort: {"request_id": False},
    Trajectory: {"trajectory_id": False, "group_id": False, "task": True},
    Prompt: {"task": True, "split": True, "uid": True},
    RolloutStats: {"rollout_id": True},  # a stats poll (the request) may leave it empty
    RepackOrder: {"order_id": False, "source_rollout": False, "target_rollout": False},
}
_ID_LISTS = {RepackOrder: "request_ids", Ack: "ids"}
# A GenerateResult's tokens, log-probs and version are the env-host's to judge
# (manager.check_result): a broken rollout's result is retried elsewhere at once, where
# a rejection here would only make the request time out.
_TOKEN_ARRAYS = {GenerateRequest: ("prompt_token_ids",), Turn: ("prompt_token_ids", "token_ids")}
# Counts and versions: never negative from a legitimate sender.
_NON_NEGATIVE = {Segment: ("tokens", "version"), Turn: ("weight_version",)}
# Floats whose non-finite values a handler accounts for (module docstring).
_MAY_BE_NON_FINITE = {(ScoredTrajectory, "reward"), (RolloutStats, "tokens_per_s"),
                      (RolloutStats, "time")}


def check_message(msg: msgspec.Struct, limits: Limits = DEFAULT_LIMITS) -> None:
    """Raise WireError (one of CONTENT_REASONS) for the first hostile value in msg."""
    _check_struct(msg, limits, type(msg).__name__)


def _check_struct(msg: msgspec.Struct, limits: Limits, where: str) -> None:
    cls = type(msg)
    ids = _IDS.get(cls, {})
    tokens = _TOKEN_ARRAYS.get(cls, ())
    non_negative = _NON_NEGATIVE.get(cls, ())
    for name in msg.__struct_fields__:
        value = getattr(msg, name)
        at = f"{where}.{name}"
        if name in ids:
            _check_id(value, limits, at, may_be_empty=ids[name])
        elif name == _ID_LISTS.get(cls):
            _check_len(value, limits, at)
            for item in value:
                _check_id(item, limits, at, may_be_empty=False)
        elif name in tokens:
            _check_array(value, limits, at, tokens=True)
        else:
            _check_value(value, limits, at, (cls, name) in _MAY_BE_NON_FINITE)
        if name in non_negative and value < 0:
            raise WireError("out_of_range", f"{at} is {value} < 0")
    if isinstance(msg, Turn):
        _check_lengths(msg, where)


def _check_value(value: Any, limits: Limits, at: str, may_be_non_finite: bool = False) -> None:
    if type(value) is int:
        if not I64_MIN <= value <= I64_MAX:
            raise WireError("out_of_range", f"{at} = {value} is outside int64")
    elif type(value) is float:
        if not may_be_non_finite and not math.isfinite(value):
            raise WireError("not_finite", f"{at} is {value}")
    elif isinstance(value, str):
        if len(value) > limits.max_text_chars:
            raise WireError("too_large", f"{at}: {len(value)} characters > {limits.max_text_chars}")
    elif isinstance(value, Array):
        _check_array(value, limits, at, tokens=False)
    elif isinstance(value, msgspec.Struct):
        _check_struct(value, limits, at)
    elif isinstance(value, (list, dict)):
        _check_len(value, limits, at)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(k, str):
                _check_value(k, limits, f"{at} key")
            _check_value(v, limits, f"{at}[{k if isinstance(k, int) else '…'}]")


def _check_len(value: list[Any] | dict[Any, Any], limits: Limits, at: str) -> None:
    if len(value) > limits.max_items:
        raise WireError("too_large", f"{at}: {len(value)} items > {limits.max_items}")


def _check_id(value: str, limits: Limits, at: str, *, may_be_empty: bool) -> None:
    if not value:
        if may_be_empty:
            return
        raise WireError("bad_id", f"{at} is empty")
    if len(value) > limits.max_id_chars:
        raise WireError("bad_id", f"{at}: {len(value)} characters > {limits.max_id_chars}")
    if not (value.isascii() and value.isprintable()):
        raise WireError("bad_id", f"{at} {value[:40]!r} is not printable ASCII")


def _check_array(value: Array, limits: Limits, at: str, *, tokens: bool) -> None:
    if len(value.shape) != 1:
        raise WireError("inconsistent", f"{at} has shape {value.shape}, not 1-D")
    if value.size > limits.max_tokens:
        raise WireError("too_large", f"{at}: {value.size} values > {limits.max_tokens}")
    if tokens and value.size:
        lo, hi = _min_max(value)
        if lo < 0 or (limits.vocab_size is not None and hi >= limits.vocab_size):
            vocab = "" if limits.vocab_size is None else f", vocabulary of {limits.vocab_size}"
            raise WireError("out_of_vocab", f"{at}: token ids from {lo} to {hi}{vocab}")


def _min_max(value: Array) -> tuple[int, int]:
    # numpy when the process has it already; never imported for this alone (a reward-host
    # does not otherwise load it, and its first message would wait for the import).
    if "numpy" in sys.modules:
        ids = value.numpy()
        return int(ids.min()), int(ids.max())
    ids = value.tolist()
    return min(ids), max(ids)


def _check_lengths(msg: Turn, where: str) -> None:
    n = msg.token_ids.size
    if msg.logprobs.size != n:
        raise WireError("inconsistent", f"{where}: {n} token ids but {msg.logprobs.size} log-probs")
    if msg.segments and sum(s.tokens for s in msg.segments) != n:
        raise WireError("inconsistent", f"{where}: segments cover "
                        f"{sum(s.tokens for s in msg.segments)} tokens of {n}")


# ----------------------------------------------------------------------------- refusals


def error_reply(msg: msgspec.Struct, why: str) -> msgspec.Struct | None:
    """The protocol's refusal of a request ``msg`` (None: the protocol has none, the
    client's timeout answers). An id that was itself the problem is not echoed: the
    reply names "invalid-id" (the client matches replies by the socket's request id)."""
    def safe(value: str) -> str:
        try:
            _check_id(value, DEFAULT_LIMITS, "id", may_be_empty=False)
        except WireError:
            return "invalid-id"
        return value

    if isinstance(msg, GenerateRequest):
        return GenerateResult(safe(msg.request_id), Int32Array(), Float32Array(), 0, "error",
                              f"rejected: {why}"[:500])
    if isinstance(msg, Abort):
        return GenerateResult(safe(msg.request_id), Int32Array(), Float32Array(), 0, "error",
                              f"rejected: {why}"[:500])
    if isinstance(msg, RepackOrder):
        return Ack([safe(msg.order_id)], False, f"rejected: {why}"[:500])
    return None


# ----------------------------------------------------------------------------- handlers

_said: set[tuple[str, str]] = set()
_said_lock = threading.Lock()


@contextlib.contextmanager
def confined(where: str, what: str = "message") -> Iterator[None]:
    """Run the handling of one message; an Exception in it is counted (handler_error),
    logged with its traceback once per exception type and ``where``, and swallowed.
    BaseException (KeyboardInterrupt, SystemExit) still ends the thread."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 — the reason this exists; see the docstring
        count_rejection(where, "handler_error")
        key = (where, type(exc).__name__)
        with _said_lock:
            first = key not in _said
            _said.add(key)
        if first:
            log.exception("%s: handling a %s failed; that %s is dropped and the daemon serves on "
                          "(later %s from here are counted, not logged)", where, what, what,
                          type(exc).__name__, extra={"event": "handler_error", "where": where})
