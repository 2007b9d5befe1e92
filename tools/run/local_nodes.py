"""What `rlfleet run`, the agent for localhost, reads and writes in etcd about this
machine's hosts: `placement/<host>/...` (what the elected resource-manager put here, read
every PLACEMENT_READ_S and kept as last read through an outage) and `nodes/<host>` (the
host's inventory, labels and daemons, bound to the run's owner lease, written when it
changed and once a TTL anyway). The supervisor (supervisor.py) decides what to do with them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.members import placements_from
from rlfleet.common.control.placement import Placed
from rlfleet.common.control.store import Lease, StoreUnavailable
from rlfleet.common.procs import ProcessId
from rlfleet.daemons.agent import policy
from rlfleet.daemons.agent.inventory import machine_inventory

PLACEMENT_READ_S = 0.5      # how often placement/ is read (and nodes/<host> rewritten if changed)


class LocalNodes:
    def __init__(self, job: str, placed: list[Placed], lease_ttl_s: float) -> None:
        self.keys = JobKeys(job)
        self.placed = placed  # what the spec places on this machine's hosts
        self.lease_ttl_s = lease_ttl_s
        self.placement: list[Placed] = []  # placement/<host>/... as last read
        self._read_at = -PLACEMENT_READ_S
        self._written: dict[str, tuple[int, dict]] = {}  # host -> (lease, value) last written
        self._written_at = 0.0
        self._inventory = machine_inventory("")
        self._registered_at = round(time.time(), 3)  # every host here registers with this run

    @property
    def hosts(self) -> set[str]:
        return {p.host for p in self.placed}

    def read_due(self) -> bool:
        """Whether placement/ is due to be read again (then it is counted as read now)."""
        now = time.monotonic()
        if now - self._read_at < PLACEMENT_READ_S:
            return False
        self._read_at = now
        return True

    def read_placement(self, store: EtcdStore) -> None:
        """placement/ for this machine's hosts; the last read stays through an outage."""
        try:
            self.placement = [Placed(p.host, p.role, p.id, p.gpus) for p in
                              placements_from(self.keys, store.get_prefix(self.keys.placement_prefix))
                              if p.host in self.hosts]
        except StoreUnavailable:
            pass

    def desired(self) -> list[Placed]:
        """The spec's resource-managers of this machine (bootstrap) and what placement/ says."""
        return sorted(set(policy.bootstrap(self.placed, self.hosts)) | set(self.placement))

    def publish(self, store: EtcdStore, lease: Lease | None, report: Callable[[float, str], dict],
                paused: bool) -> None:
        """nodes/<host> for each host here, bound to ``lease``; written when it changed, and
        once a TTL anyway (a run we took the job over from may have rebound it to its own
        lease just before it ended, which deleted it). ``report(now, host)``: the agent's
        account of the host's daemons."""
        if lease is None:
            return
        if time.monotonic() - self._written_at >= self.lease_ttl_s:
            self._written_at = time.monotonic()
            self._written.clear()
        try:
            labels = policy.parse_labels(os.environ.get("RLFLEET_LABELS", ""))
        except ValueError:
            labels = {}
        agent = {**ProcessId.current().to_fields(), "backend": "process", "registered": self._registered_at}
        for host in sorted(self.hosts):
            value = policy.node_value({**self._inventory, "host": host}, labels, agent,
                                      report(time.monotonic(), host), paused)
            if self._written.get(host) == (lease.id, value):
                continue
            try:
                store.put(self.keys.node(host), value, lease=lease)
            except StoreUnavailable:
                return
            self._written[host] = (lease.id, value)
