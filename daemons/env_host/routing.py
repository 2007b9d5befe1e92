"""Which rollout gets a turn: the live rollouts, chosen among by the routing policy
(routing_policy.py; least-loaded by our own outstanding requests unless the spec says).

The set of rollouts comes from etcd (`members/rollout/*`, their `addresses.requests`);
the daemon reads it each cycle and hands it to `Router.update` on the event loop, so
this module never touches etcd. Each rollout has one AsyncRequestClient (a DEALER).

A rollout that dies mid-request must not cost the full turn timeout: a ZeroMQ socket
monitor reports the TCP disconnect at once (a ZMTP heartbeat notices a silent peer
within 6 s), and every request in flight to that rollout fails with kind "gone", so
its EnvManager re-issues the turn elsewhere. A rollout that timed out is avoided for
`suspect_s` unless nothing else is left.

A policy may answer "wait" (``None``: every slot it would use is full; queue scheduling).
The turn then waits in a FIFO here, woken one at a time as requests finish; the wait
does not count against its turn timeout, which starts when it is sent.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
from collections.abc import Collection, Mapping
from typing import Any

import zmq
from prometheus_client import Counter
from zmq.utils.monitor import parse_monitor_message

from rlfleet.common.wire.async_client import AsyncRequestClient
from rlfleet.common.wire.messages import Abort, GenerateRequest, GenerateResult
from rlfleet.common.wire.sockets import PeerTimeout

from .routing_policy import LeastLoaded, Route, RoutingPolicy, group_of

# A turn that has to go to another rollout: the one it was on timed out, went away (a
# killed or powered-off host), or there was none. The same figures as Router.reissued.
TURNS_REISSUED = Counter("rlfleet_env_turns_reissued_total",
                         "Turns sent to another rollout, by why the first one failed", ["id", "reason"])

log = logging.getLogger("rlfleet.env_host")


class RouteError(Exception):
    """A turn did not get a result from a rollout. ``kind``: timeout, gone, no_rollout
    (none registered, or none that holds the version / is the rollout asked for)."""

    def __init__(self, kind: str, rollout_id: str, detail: str) -> None:
        super().__init__(f"{kind} ({rollout_id or 'no rollout'}): {detail}")
        self.kind, self.rollout_id, self.detail = kind, rollout_id, detail


@dataclasses.dataclass(eq=False)
class _Rollout:
    id: str
    address: str
    client: AsyncRequestClient
    monitor: zmq.Socket | None = None  # disconnect events of client.sock
    outstanding: int = 0
    suspect_until: float = 0.0
    requests: int = 0
    version: int | None = None  # the weight version it last reported (its record, its results)


class _Gone(Exception):
    """Fails the requests in flight to a rollout whose connection dropped."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class Router:
    """Live rollouts and the choice among them ([env_host.routing], least-loaded when
    not given). Use from one event loop only."""

    def __init__(self, *, suspect_s: float = 5.0, name: str = "env-host",
                 policy: RoutingPolicy | None = None) -> None:
        self.suspect_s = suspect_s
        self.policy = policy if policy is not None else LeastLoaded()
        self.name = name
        self._rollouts: dict[str, _Rollout] = {}
        self._changed = asyncio.Event()
        self._slot_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._background: set[asyncio.Task[Any]] = set()
        self.reissued = {"timeout": 0, "gone": 0, "no_rollout": 0}

    def _reissued(self, reason: str) -> None:
        self.reissued[reason] += 1
        TURNS_REISSUED.labels(self.name, reason).inc()

    # -- membership -----------------------------------------------------------------
    def update(self, rollouts: Mapping[str, str],
               versions: Mapping[str, int] | None = None) -> list[str]:
        """Make the live set exactly ``{rollout_id: requests address}``; returns what changed.
        ``versions``: the weight version each rollout's record states (continuations are
        routed to a rollout that holds theirs)."""
        said = []
        for rid in list(self._rollouts):
            r = self._rollouts[rid]
            if rollouts.get(rid) != r.address:
                self._remove(r, "left the fleet" if rid not in rollouts else "moved")
                said.append(f"rollout {rid} removed")
        for rid, address in rollouts.items():
            if rid not in self._rollouts:
                self._add(rid, address)
                said.append(f"rollout {rid} added at {address}")
        for rid, version in (versions or {}).items():
            r = self._rollouts.get(rid)
            if r is not None and (r.version is None or version > r.version):
                r.version = version
                said.append("")  # wakes continuations waiting for a holder; not a sentence
        if said:
            self._changed.set()
            self._changed = asyncio.Event()
            while self._slot_waiters:  # a new rollout may have free slots: all look again
                self._wake_one()
        return [s for s in said if s]

    def load(self) -> dict[str, int]:
        """Outstanding requests per live rollout."""
        return {rid: r.outstanding for rid, r in self._rollouts.items()}

    def __len__(self) -> int:
        return len(self._rollouts)

    def _add(self, rid: str, address: str) -> None:
        loop = asyncio.get_running_loop()
        client = AsyncRequestClient(address, expect=GenerateResult, name=f"{self.name}->{rid}")
        r = _Rollout(rid, address, client)
        r.monitor = client.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        loop.add_reader(r.monitor.FD, self._on_monitor, r)
        self._on_monitor(r)  # what came before the reader was registered re-arms the edge
        self._rollouts[rid] = r

    def _remove(self, r: _Rollout, why: str) -> None:
        del self._rollouts[r.id]
        self._fail_inflight(r, why)
        if r.monitor is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(r.monitor.FD)
        with contextlib.suppress(zmq.ZMQError):
            r.client.sock.disable_monitor()
        if r.monitor is not None:
            r.monitor.close(linger=0)
            r.monitor = None
        r.client.close()

    def _fail_inflight(self, r: _Rollout, why: str) -> None:
        if r.outstanding:
            log.info("rollout %s %s: re-issuing %d request(s) elsewhere", r.id, why, r.outstanding,
                     extra={"event": "rollout_gone", "rollout": r.id})
        r.client.fail_all(_Gone(why))

    def _on_monitor(self, r: _Rollout) -> None:
        # The monitor's descriptor is edge-triggered like any ZeroMQ socket's: read all.
        monitor = r.monitor
        with contextlib.suppress(zmq.ZMQError):
            while monitor is not None and not monitor.closed:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self._fail_inflight(r, "disconnected")

    # -- requests ---------------------------------------------------------------------
    def holders(self, version: int) -> list[str]:
        """Rollouts last known to hold this weight version."""
        return [r.id for r in self._rollouts.values() if r.version == version]

    async def generate(self, req: GenerateRequest, timeout_s: float,
                       exclude: Collection[str] = (), *, to: str | None = None,
                       version: int | None = None, tag: str = "") -> tuple[str, GenerateResult]:
        """(rollout id, result) for one turn; RouteError when there is none in time.
        ``to``: only that rollout; ``version``: only rollouts known to hold it; ``tag``:
        the prompt's kind (``Task.tag``, for hardware-affinity routing)."""
        loop = asyncio.get_running_loop()
        route = Route(group_of(req.trajectory_id), tag)
        r, deadline = await self._pick(exclude, loop.time() + timeout_s, to, version, route)
        r.outstanding += 1
        r.requests += 1
        rid, call = r.client.start(req, max(0.001, deadline - loop.time()))
        try:
            result = await call
        except _Gone as exc:
            self._reissued("gone")
            raise RouteError("gone", r.id, exc.why) from None
        except PeerTimeout as exc:
            r.suspect_until = loop.time() + self.suspect_s
            self._reissued("timeout")
            self._spawn(self._abort(r, req.request_id))
            raise RouteError("timeout", r.id, str(exc)) from None
        except (zmq.ZMQError, OSError) as exc:  # the socket went away under the call
            self._reissued("gone")
            raise RouteError("gone", r.id, repr(exc)) from None
        finally:
            r.outstanding -= 1
            self._wake_one()
            if call.cancelled():  # we were cancelled (trajectory timeout, stopping)
                self._spawn(self._abort(r, req.request_id))
            r.client.discard(rid)
        assert isinstance(result, GenerateResult)
        if result.finish_reason != "error":
            r.version = result.weight_version
        return r.id, result

    async def _pick(self, exclude: Collection[str], deadline: float, to: str | None = None,
                    version: int | None = None, route: Route | None = None) -> tuple[_Rollout, float]:
        """The rollout, and the turn's deadline (moved on by any wait for a free slot)."""
        loop = asyncio.get_running_loop()
        waited = False
        while True:
            now = loop.time()
            if to is not None or version is not None:
                # A named destination (a repack's) is taken at its word; otherwise the known
                # holders of the version first, then the rest: the request requires the
                # version, so a rollout without it answers "version" at once.
                candidates = [r for r in self._rollouts.values() if r.id not in exclude
                              and (to is None or r.id == to)]
                known = [r for r in candidates if version is None or to is not None or r.version == version]
                pools = [known, [r for r in candidates if r.version is None or r.version < version]] \
                    if version is not None and to is None else [known]
                chosen = next((p for p in pools if p), None)
                if chosen is not None:
                    picked = self.policy.choose(chosen)
                    assert picked is not None  # a continuation's choice never waits
                    return picked, deadline
                every: list[_Rollout] = []
            else:
                every = list(self._rollouts.values())
            pool = next((p for p in ([r for r in every if r.id not in exclude and r.suspect_until <= now],
                                     [r for r in every if r.id not in exclude], every) if p), None)
            if pool is not None:
                picked = self.policy.choose(pool, route)
                if picked is not None:
                    return picked, deadline
                await self._wait_for_slot(front=waited)  # woken before and beaten to it: stay first
                waited = True
                deadline += loop.time() - now
                continue
            if now >= deadline:
                self._reissued("no_rollout")
                wanted = (f"rollout {to}" if to else "live rollout") + (
                    f" holding weight version {version}" if version is not None else "")
                raise RouteError("no_rollout", "", f"no {wanted} registered")
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(deadline - now):
                    await changed.wait()

    async def _wait_for_slot(self, front: bool = False) -> None:
        waiter = asyncio.get_running_loop().create_future()
        (self._slot_waiters.appendleft if front else self._slot_waiters.append)(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._wake_one()  # we were woken for a slot we will not take: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self._slot_waiters.remove(waiter)
            raise

    def _wake_one(self) -> None:
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _abort(self, r: _Rollout, request_id: str) -> None:
        # Frees the rollout's slot; its reply (finish_reason="abort") is not needed.
        if r.client.sock.closed:
            return  # removed from the fleet (or we are stopping): nothing to free
        with contextlib.suppress(Exception):
            await r.client.request(Abort(request_id), 2.0)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def close(self) -> None:
        for r in list(self._rollouts.values()):
            self._remove(r, "env-host stopping")
        for task in self._background:
            task.cancel()
