"""One rollout's request handling over one engine, without a thread or a poll of its own.

``RolloutCore`` is what a rollout *does* with each message and between engine steps;
who waits for messages, and sends the replies the core leaves in ``take_replies()``, is
someone else, the owner of the socket: ``loop.EngineLoop`` (one engine, one thread: the
torch rollout) or ``sim.host.SimHost`` (many simulated rollouts in one thread), as vLLM's
EngineCore leaves its I/O to the process around it.

    message in -> on_message():  GenerateRequest -> add (or hold, or refuse)
                                 Abort -> abort;  RolloutStats -> reply;  RepackOrder -> hand over
    tick():      load a newer weight version when the mode allows -> admit held requests
                 -> engine.step() -> reply finished results

Weight versions by mode (``[rollout] mode``, ARCHITECTURE §4):

- ``trajectory``: the newest version is loaded when nothing runs (``WeightUpdatePolicy``);
  requests that arrive while a newer version is pending are held so the batch drains.
- ``partial``: a newer version interrupts the running requests at once; they go on,
  here, under the new version from where they stopped (re-prefill), and their results
  carry one segment per version (AReaL's partial rollout).
- ``sync`` / ``one_step_off``: every request names the version it must be generated
  with (``required_version``, set by the env-host per batch); a rollout loads exactly
  that version once nothing runs, never the newest on its own: the global barrier.

A request with ``required_version`` (a continuation after a repack or a drain, or any
request in the barrier modes) is never served by another version: in the trajectory and
partial modes a rollout that does not hold it answers at once with finish_reason
"version"; in the barrier modes a newer one waits for the load.

Every generated segment has exactly one version; results cut short end as "abort"
with their partial tokens and version (``continue_on`` names the destination when a
repack ordered it), so the env-host can continue them on the same version.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from rlfleet.common.wire.arrays import Float32Array, Int32Array
from rlfleet.common.wire.messages import Abort, Ack, GenerateRequest, GenerateResult, RepackOrder, RolloutStats, Segment
from rlfleet.common.wire.sockets import RequestServer
from rlfleet.common.wire.validation import confined
from rlfleet.daemons.rollout.engines.api import Engine, error_result

from .weight_policy import WeightUpdatePolicy

log = logging.getLogger("rlfleet.rollout")

BARRIER_MODES = ("sync", "one_step_off")
MODES = ("sync", "one_step_off", "partial", "trajectory")
_ORDERS_KEPT = 256  # repack order ids remembered for idempotence


class WeightView(Protocol):
    version: int
    tensors: dict[str, Any]


class WeightReader(Protocol):
    """What the local relay offers (rlfleet.relay.reader.WeightReader)."""

    def newest(self) -> int | None: ...

    def open(self, version: int | None = None) -> AbstractContextManager[WeightView]: ...


class ReaderSource(Protocol):
    """Who hands the engine thread its reader (``relay_source.RelayFollower``): ``get``
    returns at once, never reads etcd and never waits for a relay; None: no reader (yet)."""

    def get(self, now: float) -> WeightReader | None: ...


@dataclass
class Client:
    identity: bytes
    rid: str  # the socket-level request id the reply must carry


@dataclass
class _Carried:
    """What a request interrupted in the partial mode had made before the new version."""

    request: GenerateRequest  # as the client sent it
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)


class RolloutCore:
    def __init__(self, engine: Engine, member_id: str, *, where: str | None = None,
                 mode: str = "trajectory", hold_max_s: float = 2.0,
                 check_every_s: float = 0.05) -> None:
        """``where``: the endpoint's name, in metrics and logs (the member id when None)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.engine, self.member_id, self.mode = engine, member_id, mode
        self._where = where or member_id
        self.replies: list[tuple[bytes, str, Any]] = []  # (identity, request id, message): to send
        self.policy = WeightUpdatePolicy(check_every_s=check_every_s, hold_max_s=hold_max_s)
        self.events: deque[str] = deque()  # one sentence per version change, read by the daemon
        self.draining = False
        # When the first weight version was loaded and the first generation answered (wall
        # time): `rlfleet node add` reports a new host's phases from them.
        self.first_weights: tuple[float, int] | None = None  # (when, which version)
        self.first_result_at: float | None = None
        self.clients: dict[str, Client] = {}  # engine request id -> who to answer
        self.held: deque[tuple[float, Client, GenerateRequest]] = deque()
        self._carried: dict[str, _Carried] = {}  # partial mode: request id -> earlier segments
        self._requests: dict[str, GenerateRequest] = {}  # in the engine, as the client sent it
        self._orders: dict[str, Ack] = {}  # repack order id -> the answer given
        self._continue_on: dict[str, str] = {}  # request id -> repack destination

    # -- messages -----------------------------------------------------------------------
    def on_message(self, identity: bytes, rid: str, msg: Any, now: float) -> None:
        """Handle one request; whatever it raises is that request's failure (counted and
        logged by ``confined``), never the engine thread's."""
        client = Client(identity, rid)
        with confined(self._where, type(msg).__name__):
            if isinstance(msg, GenerateRequest):
                self._on_generate(client, msg, now)
            elif isinstance(msg, Abort):
                self._on_abort(client, msg.request_id)
            elif isinstance(msg, RolloutStats):
                self.replies.append((identity, rid, self.stats()))
            elif isinstance(msg, RepackOrder):
                self.replies.append((identity, rid, self._on_repack(msg)))

    def _on_generate(self, client: Client, req: GenerateRequest, now: float) -> None:
        version = self.engine.weight_version
        if self.draining:
            self.reply(client, error_result(req, "rollout is draining", version))
            return
        if req.request_id in self.clients or any(h[2].request_id == req.request_id for h in self.held):
            self.reply(client, error_result(
                req, f"request_id {req.request_id!r} is already waiting or running", version))
            return
        required = req.required_version
        if required is not None and required != version and (
                self.mode not in BARRIER_MODES or required < version):
            self.reply(client, _empty(req.request_id, version, "version",
                                      f"requires weight version {required}, this rollout serves {version}"))
            return
        if (required is None and self.mode not in BARRIER_MODES and self.policy.hold(version)) or (
                required is not None and required > version):
            self.held.append((now, client, req))
            return
        self._add(client, req)

    def _add(self, client: Client, req: GenerateRequest) -> None:
        self.clients[req.request_id] = client
        self._requests[req.request_id] = req
        try:
            self.engine.add(req)
        except Exception as exc:  # noqa: BLE001 — a request must never take the engine down
            self.clients.pop(req.request_id, None)
            self._requests.pop(req.request_id, None)
            self.reply(client, error_result(req, f"engine refused the request: {exc}",
                                            self.engine.weight_version))

    def _on_abort(self, client: Client, request_id: str) -> None:
        result = self.engine.abort(request_id)
        if result is None:
            for i, (_, held_client, req) in enumerate(self.held):
                if req.request_id == request_id:
                    del self.held[i]
                    self.clients[request_id] = held_client
                    result = _empty(request_id, self.engine.weight_version, "abort")
                    break
        if result is None:
            self.reply(client, _empty(request_id, self.engine.weight_version, "abort",
                                      "not waiting or running (finished, or never received)"))
            return
        result = self.answer(result)  # the generate request's own caller
        self.reply(client, result)

    def _on_repack(self, order: RepackOrder) -> Ack:
        """Hand the running generations over to ``order.target_rollout`` (same version):
        each ends here as "abort" with its tokens and ``continue_on`` set, and the
        env-host continues it there. Idempotent by order id."""
        done = self._orders.get(order.order_id)
        if done is not None:
            return done
        if order.source_rollout != self.member_id:
            ack = Ack([order.order_id], False, f"order for {order.source_rollout}, this is {self.member_id}")
        elif order.target_rollout == self.member_id:
            ack = Ack([order.order_id], False, "a rollout cannot repack onto itself")
        else:
            wanted = set(order.request_ids)
            # Everything in the engine, running or queued: the source must empty to load
            # the newest version (a queued one has no tokens and goes on unpinned).
            ids = [r for r in self._requests if not wanted or r in wanted]
            ids += [h[2].request_id for h in self.held if not wanted or h[2].request_id in wanted]
            for request_id in ids:
                self._continue_on[request_id] = order.target_rollout
            self.cut(ids, f"repack order {order.order_id} to {order.target_rollout}")
            self.release()  # the emptied rollout pulls the newest version
            ack = Ack([order.order_id, *ids], True)
        self._orders[order.order_id] = ack
        while len(self._orders) > _ORDERS_KEPT:
            self._orders.pop(next(iter(self._orders)))
        return ack

    def stats(self) -> RolloutStats:
        s = msgspec.structs.asdict(self.engine.stats())
        s["waiting"] += len(self.held)  # held for a weight load: waiting all the same
        return RolloutStats(**s, rollout_id=self.member_id, time=time.time())

    def release(self) -> None:
        self.policy.release()

    # -- between steps --------------------------------------------------------------------
    def tick(self, now: float, reader: WeightReader | None, newest: int | None = None) -> None:
        """Weights, held requests, one engine step. ``newest``: the reader's newest version
        when the caller already asked it (a host of many rollouts asks once for all)."""
        if reader is not None:
            self._update_weights(now, reader, newest)
        self._admit_held(now)
        if self.engine.has_work():
            self._step()

    def _update_weights(self, now: float, reader: WeightReader, newest: int | None) -> None:
        if self.mode in BARRIER_MODES:
            want = max((h[2].required_version or 0 for h in self.held), default=0)
            if want > self.engine.weight_version and not self.engine.has_running():
                self._load(reader, want)
            return
        if newest is not None:
            self.policy.saw(newest)
        elif self.policy.check_due(now):
            try:
                self.policy.saw(reader.newest())
            except Exception as exc:  # noqa: BLE001 — keep serving the version we have
                log.warning("weight reader newest() failed: %s", exc)
        running = self.engine.has_running()
        if self.mode == "partial" and running and self.policy.pending(self.engine.weight_version):
            self.policy.release()  # partial rollout: a new version interrupts at once
        action = self.policy.decide(self.engine.weight_version, running)
        if action.version is None:
            return
        if not action.cut_running:
            self._load(reader, action.version)
            return
        ids = self.engine.running_ids()
        if self.mode == "partial":
            cut = [r for r in (self.engine.abort(i) for i in ids) if r is not None]
            if not self._load(reader, action.version):
                # Not loaded: go on under the old version (same segments, nothing lost).
                for result in cut:
                    self._carry(result)
                return
            for result in cut:
                self._carry(result)
        else:
            self.cut(ids, "released for a weight update")
            self._load(reader, action.version)

    def _carry(self, result: GenerateResult) -> None:
        """Partial mode: re-add an interrupted request from where it stopped."""
        request_id = result.request_id
        carried = self._carried.get(request_id)
        if carried is None:
            carried = self._carried[request_id] = _Carried(self._requests[request_id])
        tokens = result.token_ids.tolist()
        if tokens:
            carried.tokens += tokens
            carried.logprobs += result.logprobs.tolist()
            carried.segments.append(Segment(len(tokens), result.weight_version))
        orig = carried.request
        prompt = Int32Array(orig.prompt_token_ids.tolist() + carried.tokens)
        rest = msgspec.structs.replace(orig, prompt_token_ids=prompt,
                                       max_new_tokens=orig.max_new_tokens - len(carried.tokens),
                                       prefix_tokens=orig.prefix_tokens + len(carried.tokens))
        if rest.max_new_tokens < 1:  # cannot happen (it would have finished): answer as is
            self._carried.pop(request_id)
            self.answer(result)
            return
        self.engine.add(rest)

    def cut(self, request_ids: list[str], why: str) -> None:
        """End these requests now (running or held) with their partial tokens, as "abort"."""
        for request_id in request_ids:
            result = self.engine.abort(request_id)
            if result is None:
                for i, (_, client, req) in enumerate(self.held):
                    if req.request_id == request_id:
                        del self.held[i]
                        self.clients[request_id] = client
                        result = _empty(request_id, self.engine.weight_version, "abort")
                        break
            if result is not None:
                log.debug("request %s ended early: %s", request_id, why)
                self.answer(result)

    def _load(self, reader: WeightReader, version: int) -> bool:
        old = self.engine.weight_version
        started = time.monotonic()
        try:
            with reader.open(version) as view:
                if view.version <= old:
                    return False
                self.engine.load_weights(view.version, view.tensors)
        except LookupError as exc:  # the relay freed it or does not hold it yet: ask again later
            log.debug("weight version %s not available yet: %s", version, exc)
            return False
        except Exception as exc:  # noqa: BLE001 — a bad version must not stop serving
            self.policy.refused(version)
            log.error("loading weight version %s failed, keeping version %s: %s", version, old, exc)
            self.events.append(f"weight version {version} refused ({exc}); serving version {old}")
            return False
        self.events.append(f"loaded weight version {self.engine.weight_version} (was {old}) "
                           f"in {time.monotonic() - started:.2f} s")
        if self.first_weights is None:
            self.first_weights = (time.time(), self.engine.weight_version)
        return True

    def _admit_held(self, now: float) -> None:
        serving = self.engine.weight_version
        if self.mode in BARRIER_MODES:
            keep: deque[tuple[float, Client, GenerateRequest]] = deque()
            for item in self.held:
                required = item[2].required_version
                if required is None or required == serving:
                    self._add(item[1], item[2])
                elif required < serving:  # the fleet moved on: say so, never mix
                    self.reply(item[1], _empty(item[2].request_id, serving, "version",
                                               f"requires weight version {required}, this rollout "
                                               f"serves {serving}"))
                else:
                    keep.append(item)
            self.held = keep
            return
        while self.held and self.policy.admit(serving, self.held[0][0], now):
            _, client, req = self.held.popleft()
            self._add(client, req)

    def _step(self) -> None:
        try:
            results = self.engine.step()
        except Exception as exc:  # noqa: BLE001 — answer everyone, keep serving
            log.exception("engine step failed; answering %d request(s) with errors", len(self.clients))
            for request_id in list(self.clients):
                try:
                    self.engine.abort(request_id)
                except Exception:  # noqa: BLE001 — the engine may be inconsistent; answer anyway
                    pass
                self._carried.pop(request_id, None)
                self.answer(error_result(request_id, f"engine step failed: {exc}",
                                         self.engine.weight_version))
            return
        for result in results:
            self.answer(result)

    # -- answers ---------------------------------------------------------------------------
    def answer(self, result: GenerateResult) -> GenerateResult:
        """Reply to the request's own caller (merging carried segments and repack hints);
        returns the result as sent."""
        request_id = result.request_id
        carried = self._carried.pop(request_id, None)
        if carried is not None:
            result = _merged(carried, result)
        self._requests.pop(request_id, None)
        destination = self._continue_on.pop(request_id, None)
        if destination and result.finish_reason == "abort":
            result = msgspec.structs.replace(result, continue_on=destination)
        client = self.clients.pop(request_id, None)
        if client is not None:
            self.reply(client, result)
        return result

    def reply(self, client: Client, result: GenerateResult) -> None:
        self.replies.append((client.identity, client.rid, result))
        if self.first_result_at is None and len(result.token_ids):
            self.first_result_at = time.time()

    def take_replies(self) -> list[tuple[bytes, str, Any]]:
        """What to send since the last call, in order; the socket's owner sends it."""
        out, self.replies = self.replies, []
        return out

    # -- draining ----------------------------------------------------------------------
    def refuse_held(self) -> None:
        self.draining = True
        for _, client, req in self.held:
            self.reply(client, error_result(req, "rollout is draining", self.engine.weight_version))
        self.held.clear()


def _merged(carried: _Carried, last: GenerateResult) -> GenerateResult:
    tokens = carried.tokens + last.token_ids.tolist()
    segments = list(carried.segments)
    if len(last.token_ids):
        segments.append(Segment(len(last.token_ids), last.weight_version))
    first_version = segments[0].version if segments else last.weight_version
    return msgspec.structs.replace(
        last, token_ids=Int32Array(tokens),
        logprobs=Float32Array(carried.logprobs + last.logprobs.tolist()),
        weight_version=first_version, segments=segments if len(segments) > 1 else [])


def _empty(request_id: str, version: int, reason: str, error: str = "") -> GenerateResult:
    return GenerateResult(request_id=request_id, token_ids=Int32Array(), logprobs=Float32Array(),
                          weight_version=version, finish_reason=reason, error=error)  # type: ignore[arg-type]


def limit_vocab(server: RequestServer, engine: Engine) -> None:
    """Token ids past the engine's vocabulary are refused at the socket, with an error reply."""
    vocab = getattr(engine, "vocab_size", None)
    if vocab is not None and hasattr(server, "limits"):
        server.limits = dataclasses.replace(server.limits, vocab_size=int(vocab))
