"""One relay's data plane: the listener, the receivers, the forwarder, the resharder.

Socket- and etcd-free apart from its transport: the daemon (or a test, or the
benchmark) feeds it the chain (`set_chain`) and it does the rest.

The forwarder keeps one connection to the current successor and, in a loop,
picks what that successor lacks (`_pick`) and pushes it chunk by chunk as the
chunks arrive here. Repair: a connection error marks the successor suspect
locally (no etcd round trip, no lease expiry to wait for), the loop computes
the next live relay down the chain, connects, and the handshake's `Want`
tells it which chunks that relay lacks, so nobody else restarts anything.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rlfleet.common import failpoints
from rlfleet.relay.admission import DEFAULT_MAX_OBJECT_BYTES, Limits
from rlfleet.relay.link import Aborted, Link, Rejected, ServeContext, serve
from rlfleet.relay.protocol import ProtocolError
from rlfleet.relay.reshard import reshard
from rlfleet.relay.shm import StoredObject, WeightStore
from rlfleet.relay.topology import ChainView
from rlfleet.relay.transport import Conn, get_transport

log = logging.getLogger("rlfleet.relay")

SUSPECT_S = 10.0  # a relay we could not reach is skipped this long unless it re-registers


@dataclass(frozen=True)
class NodeConfig:
    member_id: str
    store_dir: str
    transport: str = "tcp"
    bind_host: str = "127.0.0.1"
    window_chunks: int = 4
    keep_versions: int = 2
    reply_timeout_s: float = 10.0
    store_and_forward: bool = False  # benchmark baseline: forward a version only once it is complete here
    max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES  # largest object a peer may offer ([relay] max_object_mib)
    secret: bytes | None = field(default=None, repr=False)  # job secret: authenticate every hop (relay.auth)


class _StoredSource:
    def __init__(self, store: WeightStore, obj: StoredObject) -> None:
        self.store, self.obj = store, obj

    def wait(self, index: int, timeout: float) -> bool:
        return self.store.wait_present(self.obj, index, timeout)

    def pieces(self, index: int) -> list[memoryview]:
        return [self.obj.view(index)]


class RelayNode:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.id = config.member_id
        self.store = WeightStore(config.store_dir, config.keep_versions)
        self.transport = get_transport(config.transport, config.secret)
        self.listener = self.transport.listen(config.bind_host)
        self.address = self.listener.address
        self.chain = ChainView(None, (), {})
        self.is_master = False
        self.successor: str | None = None
        self.predecessor_seen: str | None = None
        self.suspects: dict[str, tuple[float, float]] = {}  # id -> (since, its 'started' then)
        self.repairs: list[dict[str, Any]] = []
        self.last_repair_s: float | None = None
        self.forward_errors = 0
        self.chunks_forwarded = self.bytes_forwarded = self.resends = 0
        self.forward_busy_s = 0.0
        self.corrupt_once = failpoints.relay_corrupt_chunks()  # tests: corrupted hops
        self._link: Link | None = None
        self._stop = threading.Event()
        self._changed = threading.Event()
        self._conns: set[Conn] = set()
        self._lock = threading.Lock()
        self._reshard_todo: set[tuple[int, int]] = set()
        self._serve_ctx = ServeContext(self.store, self.id, status=self.stats, on_complete=self._on_complete,
                                       limits=Limits(config.max_object_bytes))
        self._threads = [threading.Thread(target=self._accept_loop, name=f"{self.id}-accept", daemon=True),
                         threading.Thread(target=self._forward_loop, name=f"{self.id}-forward", daemon=True),
                         threading.Thread(target=self._reshard_loop, name=f"{self.id}-reshard", daemon=True)]
        self._broken_at: float | None = None

    def start(self) -> RelayNode:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()
        with self.store.cond:
            self.store.cond.notify_all()
        self.listener.close()
        with self._lock:
            for c in list(self._conns):
                c.close()
        if self._link is not None:
            self._link.close()
        for t in self._threads:
            t.join(timeout=5)
        self.store.close()

    # ---------------------------------------------------------------- chain
    def set_chain(self, chain: ChainView) -> None:
        """The daemon's view of etcd changed (members, master, requested layouts)."""
        with self._lock:
            for sid, (_, started) in list(self.suspects.items()):
                m = chain.members.get(sid)
                if m is None or m.started != started:
                    del self.suspects[sid]  # gone for good, or restarted: no longer suspect
            old_layouts = self.chain.layouts
            self.chain = chain
            self.is_master = chain.master == self.id
        if self.is_master and chain.layouts - old_layouts:
            newest = self.store.newest_complete()
            if newest is not None:
                self._queue_reshard((newest, 1))
        self._changed.set()
        with self.store.cond:
            self.store.cond.notify_all()

    def _current_successor(self) -> str | None:
        with self._lock:
            now = time.monotonic()
            for sid, (since, _) in list(self.suspects.items()):
                if now - since > SUSPECT_S:
                    del self.suspects[sid]
            return self.chain.successor(self.id, set(self.suspects))

    def _suspect(self, sid: str, why: str) -> None:
        with self._lock:
            m = self.chain.members.get(sid)
            self.suspects[sid] = (time.monotonic(), m.started if m else 0.0)
        log.warning("%s: successor %s unreachable (%s); skipping to the next live relay", self.id, sid, why)

    # ------------------------------------------------------------- receive
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn = self.listener.accept(timeout=0.5)
            except ConnectionError:
                return
            if conn is None:
                continue
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve_one, args=(conn,), name=f"{self.id}-serve", daemon=True).start()

    def _serve_one(self, conn: Conn) -> None:
        try:
            serve(conn, self._serve_ctx, self._stop)
        finally:
            with self._lock:
                self._conns.discard(conn)

    def _on_complete(self, key: tuple[int, int]) -> None:
        if key[1] == 1 and self.is_master and self.chain.layouts:
            self._queue_reshard(key)
        self.store.collect()
        with self.store.cond:
            self.store.cond.notify_all()

    # ------------------------------------------------------------- reshard
    def _queue_reshard(self, key: tuple[int, int]) -> None:
        with self.store.cond:
            self._reshard_todo.add(key)
            self.store.cond.notify_all()

    def _reshard_loop(self) -> None:
        while not self._stop.is_set():
            with self.store.cond:
                while not self._reshard_todo and not self._stop.is_set():
                    self.store.cond.wait(0.5)
                todo, self._reshard_todo = self._reshard_todo, set()
            for key in sorted(todo):
                for tp in sorted(self.chain.layouts):
                    if self.store.get((key[0], tp)) is None:
                        self._make_layout(key, tp)

    def _make_layout(self, key: tuple[int, int], tp: int) -> None:
        obj = self.store.acquire(key)
        if obj is None or not obj.complete:
            if obj is not None:
                self.store.release(obj)
            return
        try:
            started = time.monotonic()
            manifest, src = reshard(obj.manifest, obj.mm, tp)

            def fill(dst: memoryview, start: int, end: int) -> None:
                pos = 0
                for piece in src.pieces(start, end):
                    n = memoryview(piece).nbytes
                    dst[pos:pos + n] = memoryview(piece).cast("B")
                    pos += n

            self.store.put_local(manifest, fill)
            log.info("%s: version %d resharded to tp%d in %.3fs", self.id, key[0], tp, time.monotonic() - started)
        except Exception:  # noqa: BLE001 - a reshard failure must not kill the relay
            log.exception("%s: resharding version %d to tp%d failed", self.id, key[0], tp)
        finally:
            self.store.release(obj)

    # ------------------------------------------------------------- forward
    def _pick(self, peer_have: set[tuple[int, int, bool]]) -> StoredObject | None:
        """The object the successor should get next (acquired), or None."""
        peer_done = {(v, lay) for v, lay, c in peer_have if c}
        peer_started = {(v, lay) for v, lay, c in peer_have if not c}
        peer_newest = max((v for v, lay in peer_done if lay == 1), default=-1)
        mine = self.store.have()
        if not mine:
            return None
        newest_here = max(v for v, _, _ in mine)
        candidates = []
        # 1. finish what the successor already started (it may be mid-repair);
        candidates += [(v, lay) for v, lay, _ in mine if (v, lay) in peer_started and v >= peer_newest]
        # 2. otherwise the newest version here, unsharded copy first — older ones are skipped;
        candidates += [(v, lay) for v, lay, _ in sorted(mine, key=lambda x: (x[1] != 1, x[1]))
                       if v == newest_here and v >= peer_newest and (v, lay) not in peer_done]
        # 3. layouts of the successor's newest version it still lacks (made after it got the version).
        candidates += [(v, lay) for v, lay, c in mine if c and v == peer_newest and (v, lay) not in peer_done]
        complete_here = {(v, lay) for v, lay, c in mine if c}
        if self.config.store_and_forward:
            candidates = [k for k in candidates if k in complete_here]
        for key in candidates:
            if key not in complete_here and self._overtaken(key):
                continue  # our own copy stopped arriving: a newer version replaced it
            obj = self.store.acquire(key)
            if obj is not None:
                return obj
        return None

    def _forward_loop(self) -> None:
        link_peer: tuple[str, str] | None = None  # (id, address): a restarted relay has a new address
        peer_have: set[tuple[int, int, bool]] = set()
        while not self._stop.is_set():
            succ = self._current_successor()
            self.successor = succ
            member = self.chain.members.get(succ) if succ else None
            target = (succ, member.address) if succ and member else None
            if target != link_peer and self._link is not None:
                self._link.close()
                self._link, link_peer = None, None
            if succ is None:
                self._changed.wait(0.5)
                self._changed.clear()
                continue
            if self._link is None:
                try:
                    conn = self.transport.connect(member.address if member else "", timeout=2.0)
                    self._link = Link(conn, self.id, window=self.config.window_chunks,
                                      reply_timeout_s=self.config.reply_timeout_s, corrupt_once=self.corrupt_once,
                                      pace_s=failpoints.relay_pace_s())
                except (ConnectionError, ProtocolError, TimeoutError, ValueError) as exc:
                    self.forward_errors += 1
                    self._suspect(succ, f"connect: {exc}")
                    self._broken_at = self._broken_at or time.monotonic()
                    continue
                link_peer = target
                peer_have = set(self._link.peer_state.have)
                log.info("%s: forwarding to %s (%s)", self.id, succ, member.address if member else "?")
            obj = self._pick(peer_have)
            if obj is None:
                with self.store.cond:
                    self.store.cond.wait(0.2)
                continue
            key = obj.key
            try:
                pushed_at = time.monotonic()
                result = self._link.push(obj.manifest, _StoredSource(self.store, obj),
                                         abort=lambda k=key, s=succ: self._should_abort(k, s))
                self.chunks_forwarded += result.chunks_sent
                self.bytes_forwarded += result.bytes_sent
                self.forward_busy_s += result.seconds
                peer_have.discard((key[0], key[1], False))
                peer_have.add((key[0], key[1], True))
                if self._broken_at is not None:
                    # Loss detected at _broken_at; the chain carried chunks again from the next push.
                    self.last_repair_s = pushed_at - self._broken_at
                    self.repairs.append({"successor": succ, "repair_s": self.last_repair_s,
                                         "resumed_from_chunk": result.first_sent, "version": key[0]})
                    self._broken_at = None
            except Aborted:
                self._link.close()
                self._link, link_peer = None, None
            except Rejected as exc:
                log.error("%s: %s", self.id, exc)
                peer_have.add((key[0], key[1], True))  # do not offer it again to this peer
            except (ConnectionError, ProtocolError, TimeoutError) as exc:
                self.forward_errors += 1
                self._broken_at = time.monotonic()
                self._suspect(succ, str(exc))
                if self._link is not None:
                    self._link.close()
                self._link, link_peer = None, None
            finally:
                self.store.release(obj)

    def _should_abort(self, key: tuple[int, int], succ: str) -> bool:
        if self._stop.is_set() or self._current_successor() != succ:
            return True
        obj = self.store.get(key)
        return obj is not None and not obj.complete and self._overtaken(key)

    def _overtaken(self, key: tuple[int, int]) -> bool:
        newer = self.store.newest_complete(key[1])
        return newer is not None and newer > key[0]

    # ---------------------------------------------------------------- status
    def stats(self) -> dict[str, Any]:
        s = self.store
        held = s.have()
        last = [o for o in list(s.objects.values()) if o.complete and o.completed_at]
        recv_rate = 0.0
        if last:
            o = max(last, key=lambda o: o.completed_at)
            recv_rate = o.manifest.total_bytes / max(1e-9, o.completed_at - o.started)
        return {
            "id": self.id, "address": self.address, "master": self.is_master, "successor": self.successor,
            "versions": [[v, lay, c] for v, lay, c in held],
            "chunks_received": s.chunks_received, "bytes_received": s.bytes_received,
            "corrupt_chunks": s.corrupt_chunks,
            "refused": dict(self._serve_ctx.refused),  # by rule: auth, oversize, unoffered, bad_chunk, protocol
            "authenticated": self.config.secret is not None,
            "chunks_forwarded": self.chunks_forwarded, "bytes_forwarded": self.bytes_forwarded,
            "receive_bytes_per_s": round(recv_rate),
            "forward_bytes_per_s": round(self.bytes_forwarded / self.forward_busy_s) if self.forward_busy_s else 0,
            "forward_errors": self.forward_errors, "last_repair_s": self.last_repair_s,
            "repairs": list(self.repairs[-10:]),
            "progress": {f"{o.key[0]}/tp{o.key[1]}": [o.n_present, o.manifest.n_chunks]
                         for o in list(s.objects.values())},
        }
