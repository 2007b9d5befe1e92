"""The relay daemon: CPU copies of the latest weight versions in shared memory,
forwarded chunk by chunk down the relay chain (rlfleet.relay).

One per rollout machine. The data plane (listener, receivers, forwarder,
resharder) is a `RelayNode` running in its own threads; this class is the
control plane: it watches etcd for the chain (relay members, the master key,
requested layouts), campaigns for mastership when it holds the newest
version, writes `relay/chain` while it is master, and frees old versions.

Settings: the spec's `[relay]` section (transport, chunk_mib, keep_versions,
window_chunks, bind_host, max_object_mib). With `RLFLEET_JOB_SECRET_FILE` set
every hop authenticates over that job secret (relay.auth). Shared memory lives in
`$RLFLEET_RELAY_SHM_ROOT/<job>/<id>` (default root /dev/shm/rlfleet).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from rlfleet.common.control.records import RelayMaster
from rlfleet.common.control.store import KeyValue, StoreUnavailable, Watch
from rlfleet.common.daemon import Daemon
from rlfleet.common.job_secret import job_secret_from_env
from rlfleet.relay.admission import ceiling_bytes
from rlfleet.relay.node import NodeConfig, RelayNode
from rlfleet.relay.topology import ChainFollower, ChainView

log = logging.getLogger("rlfleet.relay")

SHM_ROOT = "/dev/shm/rlfleet"
FULL_READ_S = 5.0  # the watches drive the chain; a full re-read is only a safety net


class Relay(Daemon):
    role = "relay"

    node: RelayNode | None = None
    _chain: ChainView | None = None
    _written_chain: dict[str, Any] | None = None
    _said_successor: str | None = None
    _was_master = False
    _master_newest: int | None | str = "unwritten"  # the `newest` our relay/master value says
    _master_kv: KeyValue | None = None  # relay/master as this relay last wrote or saw it
    _last_full_read = 0.0

    # ------------------------------------------------------------ lifecycle
    def setup(self) -> None:
        assert self.spec is not None
        cfg = self.spec.relay
        root = os.environ.get("RLFLEET_RELAY_SHM_ROOT", SHM_ROOT)
        self.node = RelayNode(NodeConfig(
            member_id=self.options.member_id,
            store_dir=os.path.join(root, self.options.job, self.options.member_id),
            transport=cfg.transport, bind_host=cfg.bind_host, window_chunks=cfg.window_chunks,
            keep_versions=cfg.keep_versions, max_object_bytes=ceiling_bytes(self.spec),
            secret=job_secret_from_env())).start()
        self.addresses = {"chunks": self.node.address}
        self._newest_seen: tuple[int, float] = (-2, time.time())
        self._first_version_at: float | None = None  # when its store first held a whole version
        self._topology_stop = threading.Event()
        self._refresh = threading.Event()
        self._topology_thread = threading.Thread(target=self._watch_topology, name="relay-topology", daemon=True)
        self._topology_thread.start()

    def drain(self) -> str | None:
        said = []
        self._topology_stop.set()
        if self.node is not None:
            if self.node.is_master and self.session is not None and self.session.lease is not None:
                try:
                    self.store.resign(self.keys.relay_master, self.session.lease)
                    said.append("resigned as relay master")
                except StoreUnavailable:
                    pass
            self.node.stop()
            said.append("relay store released")
        return "; ".join(said) or None

    def member_info(self) -> dict[str, Any]:
        if self.node is None:
            return {}
        newest = self.node.store.newest_complete()
        newest = -1 if newest is None else newest
        if newest != self._newest_seen[0]:  # when it changed: `rlfleet status` tells stuck from in transit
            self._newest_seen = (newest, time.time())
            if newest >= 0 and self._first_version_at is None:  # `rlfleet node add`'s weights phase
                self._first_version_at = self._newest_seen[1]
        return {
            "shm_dir": str(self.node.store.dir),
            "transport": self.node.transport.name,
            "newest": newest,
            "newest_at": round(self._newest_seen[1], 3),
            **({"first_version_at": round(self._first_version_at, 3)} if self._first_version_at else {}),
            "versions": [[v, lay] for v, lay, c in self.node.store.have() if c],
            "successor": self.node.successor,
            "master": self.node.is_master,
        }

    # ------------------------------------------------------------- control
    def cycle(self) -> str | None:
        if self.node is None:
            return None
        said = []
        freed = self.node.store.collect()
        if freed:
            said.append("freed " + ", ".join(f"version {v} tp{lay}" for v, lay in freed))
        said += self._campaign_and_publish_chain()
        if self.node.successor != self._said_successor:
            self._said_successor = self.node.successor
            said.append(f"successor now {self.node.successor or 'none (end of chain)'}")
        if time.monotonic() - self._last_full_read > FULL_READ_S:
            self._last_full_read = time.monotonic()
            self._refresh.set()  # re-read etcd now and then, even if no watch event came
        return "; ".join(said) or None

    def _campaign_and_publish_chain(self) -> list[str]:
        node, chain = self.node, self._chain
        if node is None or chain is None or self.session is None or self.session.lease is None:
            return []
        said = []
        me = self.options.member_id
        try:
            if chain.master is None:
                newest = node.store.newest_complete()
                if chain.eligible_master(me, -1 if newest is None else newest):
                    if self.store.campaign(self.keys.relay_master,
                                           RelayMaster(me, time.time(), newest).to_value(), self.session.lease):
                        said.append(f"became relay master (holding version {newest})")
                        self._master_newest, self._master_kv = newest, None
                        self._refresh.set()
            if chain.master == me:
                self._keep_master_newest(node.store.newest_complete())
                value = {"master": me, "order": list(chain.order), "layouts": sorted(chain.layouts)}
                if value != self._written_chain:
                    self.store.put(self.keys.relay_chain, {**value, "updated": round(time.time(), 3)})
                    self._written_chain = value
                    said.append("chain: " + " -> ".join(chain.order))
                self._was_master = True
            elif self._was_master:
                self._was_master, self._written_chain, self._master_newest = False, None, "unwritten"
                self._master_kv = None
                said.append("no longer relay master")
        except StoreUnavailable as exc:
            said.append(f"etcd unreachable, keeping the current chain: {exc}")
        return said

    def _keep_master_newest(self, newest: int | None) -> None:
        """Keep relay/master's `newest` equal to the newest complete version this master
        holds: written once at election it said null for the whole job (a master elected
        before the first publish), while the relays held version 120."""
        assert self.session is not None and self.session.lease is not None
        if newest == self._master_newest:
            return
        # At the revision this master wrote last (one request per version); a lost swap
        # returns the key as it is, for one more try.
        kv = self._master_kv or self.store.get(self.keys.relay_master)
        for _ in range(2):
            current = RelayMaster.from_kv(kv) if kv is not None else None
            if current is None or current.lease_id != self.session.lease.id:
                self._master_kv = None
                return  # not (or no longer) ours: the next election writes its own
            value = RelayMaster(current.id, current.since, newest).to_value()
            won, kv = self.store.swap(self.keys.relay_master, current.mod_revision, value, lease=self.session.lease)
            self._master_kv = kv
            if won:
                self._master_newest = newest
                return

    def _watch_topology(self) -> None:
        """Re-derive the chain whenever relay members or relay/ keys change: from the
        watch events themselves, re-reading etcd only on a refresh (start, a broken
        watch, the FULL_READ_S safety net)."""
        watches: list[Watch] = []
        follower = ChainFollower(self.keys)
        while not self._topology_stop.is_set():
            try:
                if not watches:
                    watches = [self.store.watch_prefix(self.keys.role_members_prefix("relay")),
                               self.store.watch_prefix(self.keys.relay_prefix)]
                    self._refresh.set()
                changed = False
                for w in watches:
                    while (event := w.get(timeout=0)) is not None:
                        follower.apply(event)
                        changed = True
                if self._refresh.is_set():
                    self._refresh.clear()
                    follower.reload(self.store)
                    changed = True
                if changed:
                    self._set_chain(follower.chain())
                else:
                    self._refresh.wait(0.05)
            except StoreUnavailable as exc:
                log.warning("relay topology: etcd unreachable (%s); keeping the current chain", exc)
                self._refresh.set()  # what the watches missed meanwhile is read again
                self._topology_stop.wait(0.5)
            except Exception:  # noqa: BLE001 - the watcher must outlive any surprise
                log.exception("relay topology watcher failed; retrying")
                self._refresh.set()
                self._topology_stop.wait(0.5)
        for w in watches:
            w.cancel()

    def _set_chain(self, chain: ChainView) -> None:
        if self.node is not None:
            self.node.set_chain(chain)
        if chain.master is None and self._chain is not None and self._chain.master is not None:
            self._chain = chain
            self._wake.set()  # campaign now rather than at the next cycle
        self._chain = chain
