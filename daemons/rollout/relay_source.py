"""Which relay a rollout reads its weights from, kept current by a thread of its own.

Thread ``rollout-relay`` (``RelayFollower.start``) loops::

    look(): read members/relay/ (one etcd get_prefix) -> choose_relay() (pure)
            -> the same relay as now: nothing to do
            -> another one: build a reader pinned to its store directory, scan it once,
               then swap it in (one attribute assignment) and say so in ``events``
    wait for a change that matters (a watch on members/relay/: a relay of this host
    registered, changed its store or state, or gone), at most RESYNC_S; the back-off
    after a failed look; interval_s between looks while no watch can be opened

The watch replaced a look every second: a relay's registration changes with every
weight version, so only events about this host's relays that change what
``choose_relay`` reads wake the thread, and a fleet of rollouts no longer reads the
whole prefix once a second each.

The engine thread (``loop.EngineLoop``; ``sim_host.SimHost`` for simulated rollouts)
calls ``get(now)`` before each tick: an attribute read. It never reads etcd and never
waits for a lookup, so a slow or unreachable etcd, a dead relay or a relay replaced by
another cannot stall serving; the daemon's main loop (lease refresh, ``cycle()``) does
no relay work at all, it only reports ``events``.

Which relay: the one read from now, as long as it is registered on this host (a relay
that restarts under its id keeps its directory); when it is gone (its lease expired:
killed, or replaced by a relay with another id), the first running relay of this host in
natural id order. A rollout whose relay died with no successor yet keeps reading the
store it left behind: its complete versions stay valid.

A look that fails is retried with back-off (interval_s doubling up to max_backoff_s) and
logged once per kind of failure (etcd unreachable, no relay on this host, its store
directory missing, the reader failing) until a look succeeds again.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.members import RelayMember, members_from
from rlfleet.common.control.store import KeyValue, Store, StoreUnavailable, Watch, WatchEvent, apply_event
from rlfleet.common.threads import LoopThread
from rlfleet.relay.topology import natural_key  # the chain's order: relay-2 before relay-10

from .core import WeightReader

log = logging.getLogger("rlfleet.rollout")

RESYNC_S = 30.0  # a look without a change too: a watch that broke unnoticed cannot pin a dead relay


def choose_relay(relays: Iterable[RelayMember], host: str, current: str | None) -> RelayMember | None:
    """The relay of ``host`` to read from: ``current`` while it is registered here, else
    the first running one (then any) in natural id order; None when this host has none."""
    mine = [r for r in relays if r.host == host and r.shm_dir]
    for r in mine:
        if r.id == current:
            return r
    mine.sort(key=lambda r: (r.state != "running", natural_key(r.id)))
    return mine[0] if mine else None


class _LookFailed(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class RelayFollower(LoopThread):
    """This host's relay, followed from the ``rollout-relay`` thread; ``get(now)`` is the
    reader the engine thread uses (None until a relay was found)."""

    stop_timeout_s = 5.0

    def __init__(self, store: Store, job: str, host: str,
                 make_reader: Callable[[RelayMember], WeightReader], *,
                 interval_s: float = 1.0, max_backoff_s: float = 4.0,
                 on_switch: Callable[[], None] | None = None) -> None:
        super().__init__("rollout-relay")
        self.store, self.keys, self.host = store, JobKeys(job), host
        self.make_reader = make_reader
        self.on_switch = on_switch  # the daemon's wake(): report a switch at once
        self.interval_s, self.max_backoff_s = interval_s, max_backoff_s
        self.reader: WeightReader | None = None  # written by this thread only, read by the engine's
        self.relay: RelayMember | None = None  # the relay `reader` reads from
        self.events: deque[str] = deque()  # one sentence per switch, read by the daemon's cycle()
        self.failures = 0  # failed looks in a row
        self._logged: set[str] = set()  # failure kinds logged since the last good look
        self._seen: dict[str, tuple] = {}  # this host's relays at the last look: key -> what choose_relay reads
        self.events_let_pass = 0  # watch events that could not change the choice (tests, debugging)

    def get(self, now: float) -> WeightReader | None:
        return self.reader

    def _run(self) -> None:
        watch: Watch | None = None
        try:
            while not self._stop.is_set():
                if watch is None:
                    watch = self._open_watch()  # before the look: a change after it wakes the next
                delay = self.look()
                if self.failures or watch is None:
                    if watch is not None and self.failures:
                        watch.cancel()  # reopened after the back-off, with a fresh look
                        watch = None
                    self._stop.wait(delay)
                elif not self._await_change(watch):
                    watch.cancel()
                    watch = None
        finally:
            if watch is not None:
                watch.cancel()

    def _open_watch(self) -> Watch | None:
        try:
            return self.store.watch_prefix(self.keys.role_members_prefix("relay"))
        except StoreUnavailable:
            return None  # the look fails too and backs off; the watch is tried again after

    def _await_change(self, watch: Watch) -> bool:
        """Until an event that may change the choice, RESYNC_S, or stop; False when the
        watch failed (the next pass opens another)."""
        deadline = time.monotonic() + RESYNC_S
        while not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
            try:
                event = watch.get(timeout=min(0.5, left))
            except StoreUnavailable:
                return False
            if event is not None:
                if self._matters(event):
                    return True
                self.events_let_pass += 1
        return True

    def _matters(self, event: WatchEvent) -> bool:
        if event.kind == "delete":
            return event.key in self._seen
        written: dict[str, KeyValue] = {}
        apply_event(written, event)  # the registration the put wrote, as a read returns it
        relays = [RelayMember.of(m) for m in members_from(self.keys, list(written.values())) if m.role == "relay"]
        if not relays or relays[0].host != self.host:
            return event.key in self._seen  # moved away from this host (or malformed): look again
        return _fingerprint(relays[0]) != self._seen.get(event.key)

    def look(self) -> float:
        """One look at etcd (switching relays if needed); the seconds until the next."""
        try:
            self._follow()
        except Exception as exc:  # noqa: BLE001 — the thread outlives any surprise, and says so once
            kind = exc.kind if isinstance(exc, _LookFailed) else (
                "etcd" if isinstance(exc, StoreUnavailable) else "error")
            self.failures += 1
            delay = min(self.interval_s * 2 ** (self.failures - 1), self.max_backoff_s)
            if kind not in self._logged:
                self._logged.add(kind)
                keeping = f"still reading relay {self.relay.id}'s store" if self.relay else "no reader yet"
                log.warning("relay lookup: %s; %s, retrying with back-off up to %.0f s",
                            exc if kind != "error" else repr(exc), keeping, self.max_backoff_s,
                            extra={"event": f"relay_{kind}"})
            return delay
        if self._logged:
            log.info("relay lookup works again after %d failed look(s)", self.failures,
                     extra={"event": "relay_ok"})
        self.failures, self._logged = 0, set()
        return self.interval_s

    def _follow(self) -> None:
        kvs = self.store.get_prefix(self.keys.role_members_prefix("relay"))
        relays = [RelayMember.of(m) for m in members_from(self.keys, kvs) if m.role == "relay"]
        self._seen = {self.keys.member("relay", r.id): _fingerprint(r) for r in relays if r.host == self.host}
        current = self.relay.id if self.relay else None
        target = choose_relay(relays, self.host, current)
        if target is None:
            raise _LookFailed("no_relay", f"no relay registered on host {self.host}")
        if self.relay is not None and (target.id, target.shm_dir) == (self.relay.id, self.relay.shm_dir):
            return
        if not Path(target.shm_dir).is_dir():
            raise _LookFailed("no_store", f"relay {target.id}'s store {target.shm_dir} does not exist")
        try:
            reader = self.make_reader(target)
            newest = reader.newest()  # one directory scan here, so the engine thread gets a working reader
        except Exception as exc:  # noqa: BLE001
            raise _LookFailed("reader", f"reader for relay {target.id} ({target.shm_dir}) failed: {exc!r}") from exc
        self.reader, self.relay = reader, target
        was = f" (was {current})" if current else ""
        self.events.append(f"reading weights from relay {target.id}{was}, "
                           f"which holds {'no version yet' if newest is None else f'version {newest}'}")
        if self.on_switch is not None:
            self.on_switch()


def _fingerprint(relay: RelayMember) -> tuple:
    """What choose_relay and the reader depend on in a relay's registration."""
    return (relay.id, relay.shm_dir, relay.state)
