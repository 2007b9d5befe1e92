"""`Store` over a real etcd cluster, through etcd-sdk-python (`pyetcd`).

Why this client: etcd3 0.12 breaks on modern protobuf; pyetcd is its maintained
fork with a multi-endpoint client (see shared/FINDINGS.md). It does not retry a
failed call itself, it only marks the endpoint failed, so every call here goes
through `_call`, which tries each endpoint once before giving up with
`StoreUnavailable`.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
import pyetcd
from pyetcd import etcdrpc
from pyetcd import exceptions as etcd_exc

from rlfleet.common.control.etcd_auth import EtcdCredentials, raise_if_refused, tls_hint
from rlfleet.common.control.etcd_channels import UNREACHABLE, new_client, renew_failed_channels
from rlfleet.common.control.keys import ROOT_PREFIX
from rlfleet.common.control.store import (
    KeyValue,
    Lease,
    LeaseExpired,
    LeaseInfo,
    Store,
    StoreUnavailable,
    Watch,
    WatchEvent,
)

log = logging.getLogger("rlfleet.store")

T = TypeVar("T")

_REVISION_KEY = ROOT_PREFIX.encode()  # a key nobody writes: reading it returns only the header


def parse_endpoints(endpoints: str | list[str]) -> list[tuple[str, int]]:
    """'h1:2379,h2:2379' or ['h1:2379', ...] -> [(host, port), ...]."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    parsed = []
    for item in items:
        item = item.strip().removeprefix("http://")
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint must be host:port, got {item!r}")
        parsed.append((host, int(port)))
    if not parsed:
        raise ValueError("no etcd endpoints given")
    return parsed


def _encode(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def _decode(raw: bytes | None) -> Any:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        # Someone wrote a non-JSON value by hand; show it rather than crash.
        return raw.decode("utf-8", "replace")


class EtcdStore(Store):
    def __init__(self, endpoints: str | list[str], timeout_s: float = 1.0,
                 creds: EtcdCredentials | None = None) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.timeout_s = timeout_s
        self.creds = creds or EtcdCredentials()
        self._tls = self.creds.channel_credentials()  # files read once, errors at start-up
        self._password = self.creds.password()
        self._client = self._new_client()
        # pyetcd's multi-endpoint client keeps unsynchronised stub caches.
        self._lock = threading.RLock()
        self._keepalive: _KeepAliveStream | None = None

    def _new_client(self) -> pyetcd.MultiEndpointEtcd3Client:
        return new_client(self.endpoints, self._tls, self.timeout_s)

    def _logged_in_client(self) -> pyetcd.MultiEndpointEtcd3Client:
        """A new client with its auth token (for a watch, which keeps its own client)."""
        client = self._new_client()
        for _ in range(len(self.endpoints) + 1):
            try:
                self._login(client)
                return client
            except UNREACHABLE:
                renew_failed_channels(client)
                continue
        client.close()
        raise StoreUnavailable(f"etcd login: no endpoint answered ({self.describe()})")

    def _login(self, c: pyetcd.MultiEndpointEtcd3Client) -> None:
        """Get an etcd auth token for this client when a user is configured. pyetcd would
        do it in the client's constructor, which then fails whenever etcd is down; and the
        token goes as plain metadata: gRPC refuses call credentials on a plaintext channel."""
        if self._password is None or c.metadata is not None:
            return
        try:  # read again: a password changed on disk is used at the next login, no restart
            self._password = self.creds.password() or self._password
        except OSError:
            pass  # keep the one read at start
        request = etcdrpc.AuthenticateRequest(name=self.creds.user, password=self._password)
        try:
            token = c.authstub.Authenticate(request, self.timeout_s).token
        except grpc.RpcError as exc:
            raise_if_refused(exc, "login")
            c._manage_grpc_errors(exc)  # marks the endpoint failed, raises pyetcd's error
            raise
        c.metadata = (("token", token),)

    def _call(self, what: str, fn: Callable[[pyetcd.MultiEndpointEtcd3Client], T]) -> T:
        last: BaseException | None = None
        first: BaseException | None = None  # its gRPC cause says why (later tries: "endpoint failed")
        relogged = False
        # One try per endpoint, plus one: the first failure only marks the endpoint.
        tries = len(self.endpoints) + 1
        while tries > 0:
            tries -= 1
            try:
                with self._lock:
                    self._login(self._client)
                    return fn(self._client)
            except grpc.RpcError as exc:
                if (exc.code() == grpc.StatusCode.UNAUTHENTICATED and self._password is not None
                        and not relogged):
                    # The token expired, or etcd restarted and forgot it: log in again.
                    relogged, tries = True, tries + 1
                    with self._lock:
                        self._client.metadata = None
                        self._drop_keepalive()
                    continue
                raise_if_refused(exc, what)
                last, first = exc, first or exc
            except UNREACHABLE as exc:
                last, first = exc, first or exc
                with self._lock:
                    renew_failed_channels(self._client)
        raise StoreUnavailable(f"etcd {what}: no endpoint answered ({self.describe()}): "
                               f"{last!r}{tls_hint(first, self._tls is not None)}")

    def _drop_keepalive(self) -> None:
        if self._keepalive is not None:
            self._keepalive.close()
            self._keepalive = None

    def describe(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    # -- plain keys -------------------------------------------------------
    def get(self, key: str) -> KeyValue | None:
        value, meta = self._call("get", lambda c: c.get(key))
        if meta is None:
            return None
        return KeyValue(key, _decode(value), meta.create_revision, meta.mod_revision, meta.lease_id)

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        items = self._call("get_prefix", lambda c: list(c.get_prefix(prefix, sort_order="ascend")))
        return [KeyValue(m.key.decode(), _decode(v), m.create_revision, m.mod_revision, m.lease_id)
                for v, m in items]

    def leases_under(self, prefix: str) -> dict[str, int]:
        items = self._call("leases_under", lambda c: list(c.get_prefix(prefix, keys_only=True)))
        return {m.key.decode(): m.lease_id for _, m in items}

    def put(self, key: str, value: Any, lease: Lease | None = None) -> int:
        resp = self._call("put", lambda c: c.put(key, _encode(value), lease=lease.id if lease else None))
        return resp.header.revision

    def delete(self, key: str) -> bool:
        return bool(self._call("delete", lambda c: c.delete(key)))

    def delete_prefix(self, prefix: str) -> int:
        return self._call("delete_prefix", lambda c: c.delete_prefix(prefix)).deleted

    def compare_and_swap(self, key: str, expected_mod_revision: int, value: Any,
                         lease: Lease | None = None) -> bool:
        def txn(c: pyetcd.MultiEndpointEtcd3Client) -> bool:
            t = c.transactions
            ok, _ = c.transaction(
                compare=[t.mod(key) == expected_mod_revision],
                success=[t.put(key, _encode(value), lease=lease.id if lease else None)],
                failure=[],
            )
            return ok
        return self._call("compare_and_swap", txn)

    def swap(self, key: str, expected_mod_revision: int, value: Any,
             lease: Lease | None = None) -> tuple[bool, KeyValue | None]:
        encoded = _encode(value)
        lease_id = lease.id if lease else 0

        def txn(c: pyetcd.MultiEndpointEtcd3Client) -> tuple[bool, KeyValue | None]:
            t = c.transactions
            # prev_kv: the key's create_revision (unchanged by an update) without a read.
            resp = _raw_txn(c, compare=[t.mod(key) == expected_mod_revision],
                            success=[t.put(key, encoded, lease=lease_id or None, prev_kv=True)],
                            failure=[t.get(key)])
            if resp.succeeded:
                prev = resp.responses[0].response_put.prev_kv
                revision = resp.header.revision  # the txn's one write: the key's new mod_revision
                created = prev.create_revision if prev.create_revision else revision
                return True, KeyValue(key, _decode(encoded.encode()), created, revision, lease_id)
            return False, _failed_get(resp, key)
        return self._call("swap", txn)

    def put_owned(self, key: str, value: Any, lease: Lease) -> tuple[bool, KeyValue | None]:
        def txn(c: pyetcd.MultiEndpointEtcd3Client) -> tuple[bool, KeyValue | None]:
            t = c.transactions
            # An absent key compares as lease 0, which no granted lease has: never created here.
            resp = _raw_txn(c, compare=[_LeaseCompare(key, lease.id)],
                            success=[t.put(key, _encode(value), lease=lease.id)], failure=[t.get(key)])
            if resp.succeeded:
                return True, None
            return False, _failed_get(resp, key)
        return self._call("put_owned", txn)

    def put_all(self, values: dict[str, Any], expected_mod_revisions: dict[str, int]) -> bool:
        """Every put in one transaction, done only if each key still has the mod revision
        given (0: absent); etcd takes up to --max-txn-ops (128) of each."""
        def txn(c: pyetcd.MultiEndpointEtcd3Client) -> bool:
            t = c.transactions
            ok, _ = c.transaction(compare=[t.mod(k) == r for k, r in expected_mod_revisions.items()],
                                  success=[t.put(k, _encode(v)) for k, v in values.items()], failure=[])
            return ok
        return self._call("put_all", txn)

    def compare_and_swap_delete(self, key: str, expected_mod_revision: int) -> bool:
        def txn(c: pyetcd.MultiEndpointEtcd3Client) -> bool:
            t = c.transactions
            ok, _ = c.transaction(compare=[t.mod(key) == expected_mod_revision],
                                  success=[t.delete(key)], failure=[])
            return ok
        return self._call("compare_and_swap_delete", txn)

    def revision(self) -> int:
        # Any read returns the store's revision; this key is inside the prefix a job's etcd
        # role may read (docs/operations/security.md), where b"\0" would be refused with etcd auth on.
        return self._call("revision", lambda c: c.get_response(_REVISION_KEY).header.revision)

    # -- leases -----------------------------------------------------------
    def grant_lease(self, ttl_s: int | float) -> Lease:
        ttl = max(2, math.ceil(ttl_s))  # etcd leases are whole seconds; etcd's floor is ~1.5 s
        lease = self._call("grant_lease", lambda c: c.lease(ttl))
        return Lease(lease.id, ttl)

    def refresh_lease(self, lease: Lease) -> int:
        def refresh(c: pyetcd.MultiEndpointEtcd3Client) -> Any:
            stream = self._keepalive
            if stream is None or stream.stub is not c.leasestub:  # first use, or the client failed over
                if stream is not None:
                    stream.close()
                stream = self._keepalive = _KeepAliveStream(c)
            try:
                return stream.refresh(lease.id, self.timeout_s)
            except BaseException as exc:
                stream.close()
                self._keepalive = None
                if isinstance(exc, grpc.RpcError):
                    c._manage_grpc_errors(exc)  # marks the endpoint failed, raises pyetcd's error
                if isinstance(exc, TimeoutError):
                    c.endpoint_in_use.fail()  # as a deadline exceeded on a unary call would
                    c._clear_old_stubs()
                    raise etcd_exc.ConnectionTimeoutError() from None
                raise
        ttl = self._call("refresh_lease", refresh).TTL
        if ttl <= 0:
            raise LeaseExpired(f"lease {lease.id:x} expired")
        return ttl

    def revoke_lease(self, lease: Lease) -> None:
        def revoke(c: pyetcd.MultiEndpointEtcd3Client) -> None:
            try:
                c.revoke_lease(lease.id)
            except grpc.RpcError as exc:
                # "lease not found" is etcd's answer, not an outage (_call would retry every
                # endpoint and say unreachable): expired or revoked already is what we want.
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
        self._call("revoke_lease", revoke)

    def lease_remaining(self, lease_id: int) -> int:
        return self._call("lease_remaining", lambda c: c.get_lease_info(lease_id)).TTL

    def lease_info(self, lease_id: int) -> LeaseInfo:
        info = self._call("lease_info", lambda c: c.get_lease_info(lease_id))
        if info.TTL < 0:
            return LeaseInfo(-1, 0)
        return LeaseInfo(info.TTL, info.grantedTTL, frozenset(k.decode() for k in info.keys))

    # -- watches ----------------------------------------------------------
    def watch_prefix(self, prefix: str, start_revision: int | None = None) -> Watch:
        # Each watch gets its own client: pyetcd closes a client's watcher
        # whenever a unary call fails over, which would silently end the watch.
        if start_revision is None:
            # Pin "now" to a revision so a break before the first event loses nothing.
            start_revision = self.revision() + 1
        return _EtcdWatch(self._logged_in_client, prefix, start_revision)

    def close(self) -> None:
        with self._lock:
            if self._keepalive is not None:
                self._keepalive.close()
                self._keepalive = None
            self._client.close()


class _LeaseCompare:
    """`lease(key) == lease_id` for a transaction (etcd >= 3.3; pyetcd has no helper)."""

    def __init__(self, key: str, lease_id: int) -> None:
        self.key, self.lease_id = key, lease_id

    def build_message(self) -> Any:
        return etcdrpc.Compare(key=self.key.encode(), result=etcdrpc.Compare.EQUAL,
                               target=etcdrpc.Compare.LEASE, lease=self.lease_id)


def _raw_txn(c: pyetcd.MultiEndpointEtcd3Client, compare: list[Any], success: list[Any],
             failure: list[Any]) -> Any:
    """pyetcd's `transaction()` minus the part that drops the response header (whose
    revision is the new mod_revision of what the txn wrote). Errors go through the
    client's own handler, so a dead endpoint is marked failed exactly as for its calls."""
    request = etcdrpc.TxnRequest(compare=[x.build_message() for x in compare],
                                 success=c._ops_to_requests(success), failure=c._ops_to_requests(failure))
    try:
        return c.kvstub.Txn(request, c.timeout, credentials=c.call_credentials, metadata=c.metadata)
    except grpc.RpcError as exc:
        c._manage_grpc_errors(exc)  # raises pyetcd's exception for this code
        raise


def _failed_get(resp: Any, key: str) -> KeyValue | None:
    """What a failed txn's one ``get(key)`` found: the key as it stands, or None if absent."""
    kvs = resp.responses[0].response_range.kvs
    if not kvs:
        return None
    kv = kvs[0]
    return KeyValue(key, _decode(kv.value), kv.create_revision, kv.mod_revision, kv.lease)


class _KeepAliveStream:
    """One LeaseKeepAlive stream that every refresh reuses. pyetcd opens a new stream per
    refresh, which cost ~0.75 ms more client CPU than a unary call, plus a stream set-up
    in etcd, in every cycle of every daemon. Callers serialise refreshes (EtcdStore's
    lock), so the one response in flight is the answer to the one request; after any
    error or timeout the stream is dropped, so a late answer is never taken for a new one."""

    _END = object()

    def __init__(self, c: pyetcd.MultiEndpointEtcd3Client) -> None:
        self.stub = c.leasestub
        self._requests: queue.Queue[Any] = queue.Queue()
        self._responses: queue.Queue[Any] = queue.Queue()
        # No deadline: the stream lives until closed; each refresh has its own timeout.
        self._call = self.stub.LeaseKeepAlive(iter(self._requests.get, self._END),
                                              credentials=c.call_credentials, metadata=c.metadata)
        threading.Thread(target=self._read, name="lease-keepalive", daemon=True).start()

    def _read(self) -> None:
        try:
            for response in self._call:
                self._responses.put(response)
            self._responses.put(etcd_exc.ConnectionFailedError())  # etcd ended the stream
        except grpc.RpcError as exc:
            self._responses.put(exc)

    def refresh(self, lease_id: int, timeout_s: float) -> Any:
        self._requests.put(etcdrpc.LeaseKeepAliveRequest(ID=lease_id))
        try:
            item = self._responses.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no keep-alive answer within {timeout_s}s") from None
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._requests.put(self._END)
        self._call.cancel()


class _EtcdWatch(Watch):
    """A watch thread that re-subscribes from `last_revision + 1` after any break."""

    def __init__(self, make_client: Callable[[], pyetcd.MultiEndpointEtcd3Client], prefix: str,
                 start_revision: int) -> None:
        self._make_client = make_client
        self._prefix = prefix
        self._next_revision = start_revision
        self._last_revision = start_revision - 1
        self._events: queue.Queue[WatchEvent | None] = queue.Queue()
        self._stop = threading.Event()
        self.reconnects = 0
        self._thread = threading.Thread(target=self._run, name=f"watch:{prefix}", daemon=True)
        self._thread.start()

    @property
    def last_revision(self) -> int:
        return self._last_revision

    def get(self, timeout: float | None = None) -> WatchEvent | None:
        try:
            event = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        if event is None:  # cancelled
            self._events.put(None)
        return event

    def cancel(self) -> None:
        self._stop.set()
        self._events.put(None)

    def _run(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            client = self._make_client()
            responses: queue.Queue[Any] = queue.Queue()
            try:
                # One failover per try: the first failure marks the endpoint.
                watch_id = None
                for _ in range(len(client.endpoints) + 1):
                    try:
                        watch_id = client.add_watch_prefix_callback(
                            self._prefix, responses.put, start_revision=self._next_revision)
                        break
                    except UNREACHABLE:
                        renew_failed_channels(client)
                        continue
                if watch_id is None:
                    raise StoreUnavailable("no endpoint accepted the watch")
                backoff = 0.05
                while not self._stop.is_set():
                    try:
                        item = responses.get(timeout=0.2)
                    except queue.Empty:
                        continue
                    if isinstance(item, etcd_exc.RevisionCompactedError):
                        # Events we had not seen are gone for good; resume from the
                        # oldest revision still kept and say so loudly.
                        log.error("watch %s: revisions before %d were compacted; events lost",
                                  self._prefix, item.compacted_revision)
                        self._next_revision = item.compacted_revision
                        raise item
                    if isinstance(item, BaseException):
                        raise item
                    for ev in item.events:
                        kind = "delete" if isinstance(ev, pyetcd.events.DeleteEvent) else "put"
                        self._last_revision = ev.mod_revision
                        self._next_revision = ev.mod_revision + 1
                        self._events.put(WatchEvent(kind, ev.key.decode(),
                                                    None if kind == "delete" else _decode(ev.value),
                                                    ev.mod_revision))
            except Exception as exc:  # noqa: BLE001 — any break means: re-subscribe
                if self._stop.is_set():
                    break
                self.reconnects += 1
                log.warning("watch %s broke (%r); re-watching from revision %s in %.2fs",
                            self._prefix, exc, self._next_revision, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                try:
                    client.close()
                except Exception:  # noqa: BLE001
                    pass
