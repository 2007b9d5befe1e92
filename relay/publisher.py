"""Trainer side of the weight plane: push a version to the master relay.

`publish()` returns as soon as the master holds the whole version, verified:
the trainer's stall is one transfer to one relay, whatever the chain's length
(the master forwards while the trainer trains). It finds the master through
etcd (`relay/master` -> the master's member registration -> its `chunks`
address); if the master dies mid-push, it waits for the next master to be
elected and resumes there (the handshake says which chunks that relay already
has, e.g. everything the old master had forwarded to it).

Fencing (docs/operations/failsafe.md): a publisher given its trainer leader's ``term`` stamps it
into weights/latest and will not publish under a term older than the one recorded
there: a trainer that was superseded gets `PublishFenced` instead of a version that
downstream could take.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy

from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.members import Member
from rlfleet.common.control.records import RelayMaster, WeightsLatest
from rlfleet.common.control.store import KeyValue, Store, StoreUnavailable
from rlfleet.common.job_secret import job_secret_from_env
from rlfleet.relay.link import Link, Rejected
from rlfleet.relay.manifest import FlatSource, Manifest, build_manifest
from rlfleet.relay.protocol import ProtocolError
from rlfleet.relay.transport import get_transport, transport_for

log = logging.getLogger("rlfleet.relay")

# While the link to the master works, etcd is asked who the master is at most this often
# (two reads per lookup, which at a version per training step were most of the trainer's
# etcd traffic). A failed push drops the link and looks the master up again at once.
MASTER_RECHECK_S = 1.0


class PublishError(Exception):
    """Base of the publisher's named errors."""


class PublishTimeout(PublishError):
    """No master relay took the whole version within timeout_s."""


class PublishRejected(PublishError):
    """The master refused the version (e.g. the same version number with other contents)."""


class PublishFenced(PublishError):
    """weights/latest carries a newer leader term than ours: another trainer leads."""


@dataclass(frozen=True)
class PublishReport:
    version: int
    bytes: int
    checksum: str
    master: str
    seconds: float           # the trainer's stall: manifest + transfer to the master
    manifest_s: float        # of which: layout and checksums
    chunks: int
    chunks_sent: int         # fewer than `chunks` when a retry resumed on a master that had some
    attempts: int


class _FullSource:
    def __init__(self, manifest: Manifest, src: FlatSource) -> None:
        self.manifest, self.src = manifest, src

    def wait(self, index: int, timeout: float) -> bool:
        return True

    def pieces(self, index: int) -> Any:
        return self.src.pieces(*self.manifest.chunk_range(index))


class WeightPublisher:
    def __init__(self, store: Store, job: str, *, transport: str = "tcp", chunk_bytes: int = 32 << 20,
                 timeout_s: float = 60.0, window_chunks: int = 4, name: str = "trainer",
                 term: Callable[[], int] = lambda: 0, secret: bytes | None = None) -> None:
        """``term``: the publishing leader's fencing term now (Session.term; 0: unfenced).
        `secret`: the job secret the relays authenticate with; None: RLFLEET_JOB_SECRET_FILE's
        (common.job_secret), and no authentication when that is unset too."""
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._secret = secret if secret is not None else job_secret_from_env()
        get_transport(transport, self._secret)  # fail now on an unknown or unavailable transport
        self.store, self.keys = store, JobKeys(job)
        self.transport, self.chunk_bytes, self.timeout_s = transport, chunk_bytes, timeout_s
        self.window, self.name, self.term = window_chunks, name, term
        self._link: Link | None = None
        self._link_to: tuple[str, str] | None = None  # (master id, address)
        self._link_checked = 0.0  # monotonic time the link's master was last confirmed in etcd
        self._latest_kv: KeyValue | None = None  # weights/latest as this publisher last saw or wrote it

    def _current_master(self) -> tuple[str, str] | None:
        now = time.monotonic()
        if self._link is not None and now - self._link_checked < MASTER_RECHECK_S:
            return self._link_to
        target = self._find_master()
        if target is not None and target == self._link_to:
            self._link_checked = now
        return target

    def _find_master(self) -> tuple[str, str] | None:
        master = RelayMaster.read(self.store, self.keys)
        if master is None or not master.id:
            return None
        mid = master.id
        kv = self.store.get(self.keys.member("relay", mid))
        addr = Member.from_kv(self.keys, kv).address("chunks") if kv is not None else None
        if not addr:
            return None
        if not addr.startswith(self.transport + "://"):
            log.warning("master relay %s serves %s, not %s; using its transport", mid, addr, self.transport)
        return mid, str(addr)

    def _connect(self, target: tuple[str, str]) -> Link:
        if self._link is not None and self._link_to == target:
            return self._link
        self._drop_link()
        conn = transport_for(target[1], self._secret).connect(target[1], timeout=5.0)
        self._link = Link(conn, self.name, role="publisher", window=self.window)
        self._link_to, self._link_checked = target, time.monotonic()
        return self._link

    def _drop_link(self) -> None:
        if self._link is not None:
            self._link.close()
        self._link, self._link_to = None, None

    def _check_term(self, term: int, kv: KeyValue | None) -> None:
        recorded = WeightsLatest.from_kv(kv).term if kv is not None else 0
        if recorded > term:
            raise PublishFenced(f"{self.keys.weights_latest} was written under term {recorded}, "
                                f"newer than ours ({term}): another trainer leads")

    def publish(self, version: int, tensors: Mapping[str, numpy.ndarray]) -> PublishReport:
        # What this publisher last saw of weights/latest (read again on a new term): a
        # newer term there fences us before a single chunk reaches the relay.
        term = self.term()
        if term and (self._latest_kv is None or WeightsLatest.from_kv(self._latest_kv).term != term):
            try:
                self._latest_kv = self.store.get(self.keys.weights_latest)
            except StoreUnavailable:
                pass  # checked again when the version is recorded
        self._check_term(term, self._latest_kv)
        started = time.monotonic()
        manifest, src = build_manifest(version, tensors, chunk_bytes=self.chunk_bytes)
        manifest_s = time.monotonic() - started
        source = _FullSource(manifest, src)
        deadline = started + self.timeout_s
        attempts, sent, last_error = 0, 0, "no master relay registered"
        while time.monotonic() < deadline:
            try:
                target = self._current_master()
            except StoreUnavailable as exc:
                target, last_error = None, f"etcd unreachable: {exc}"
            if target is None:
                time.sleep(0.05)
                continue
            attempts += 1
            try:
                link = self._connect(target)
                result = link.push(manifest, source)
                sent += result.chunks_sent
            except Rejected as exc:
                raise PublishRejected(str(exc)) from None
            except (ConnectionError, ProtocolError, TimeoutError) as exc:
                last_error = f"master {target[0]} at {target[1]}: {exc}"
                log.warning("publish of version %d: %s; retrying with the current master", version, last_error)
                self._drop_link()
                self._wait_for_new_master(target, deadline)
                continue
            self._record_latest(manifest, target[0])
            return PublishReport(version, manifest.total_bytes, manifest.checksum, target[0],
                                 time.monotonic() - started, manifest_s, manifest.n_chunks, sent, attempts)
        raise PublishTimeout(f"version {version} ({manifest.total_bytes} bytes) not held by a master relay "
                             f"within {self.timeout_s:g}s after {attempts} attempts; last error: {last_error}")

    def _wait_for_new_master(self, dead: tuple[str, str], deadline: float) -> None:
        # The dead master's key lingers until its lease expires; meanwhile, asking it again is pointless.
        while time.monotonic() < deadline:
            try:
                target = self._find_master()
            except StoreUnavailable:
                target = None
            if target is not None and target != dead:
                return
            if target == dead:
                try:  # still registered: maybe it was a transient error
                    transport_for(dead[1], self._secret).connect(dead[1], timeout=0.5).close()
                    return
                except (ConnectionError, ProtocolError):
                    pass
            time.sleep(0.1)

    def _record_latest(self, manifest: Manifest, master: str) -> None:
        """weights/latest = {version, bytes, checksum, master}; never moves backwards.

        One transaction per version: the swap is made at the revision this publisher
        wrote last time, and a swap that loses (first publish, another trainer, an
        operator) returns the key as it is, which the next try decides on."""
        key = self.keys.weights_latest
        term = self.term()
        value = WeightsLatest(manifest.version, manifest.total_bytes, manifest.checksum, master,
                              term).to_value()
        kv = self._latest_kv
        for _ in range(6):  # the first try may use a stale revision; then as many as before
            try:
                self._check_term(term, kv)
                # A malformed value (version -1) is overwritten: it describes no version.
                if kv is not None and WeightsLatest.from_kv(kv).version > manifest.version:
                    self._latest_kv = kv
                    return
                won, kv = self.store.swap(key, kv.mod_revision if kv else 0, value)
                self._latest_kv = kv
                if won:
                    return
            except StoreUnavailable as exc:
                log.warning("could not record %s (etcd unreachable: %s); the relays hold the version anyway", key, exc)
                return

    def close(self) -> None:
        self._drop_link()
