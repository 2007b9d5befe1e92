"""The resource-manager daemon.

The elected leader reconciles `placement/...` with what should run where: the
spec's named hosts, hosts admitted into the spec's pools, and the operator's
cordons and drains (admission.py decides; this module reads and writes etcd).
Standbys wait. The node agents (daemons/agent/) act on that placement and
record each machine's inventory under `nodes/<host>`. While the job is paused
(`rlfleet pause`) nothing is admitted, placed or unplaced.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from rlfleet.common.control.cluster import Cluster
from rlfleet.common.control.members import Placement
from rlfleet.common.control.operations import DRAINED
from rlfleet.common.control.store import KeyValue, StoreUnavailable
from rlfleet.common.daemon import Daemon
from rlfleet.common.spec.job import JobSpec
from rlfleet.common.spec.placement import ROLES
from rlfleet.daemons.resource_manager.admission import Decision, Fleet, decide, describe_labels

log = logging.getLogger("rlfleet.resource_manager")


def _placed(keys, kv: KeyValue) -> Placement | None:
    """The placement record, or None for a key under placement/ that names no daemon."""
    try:
        return Placement.from_kv(keys, kv)
    except ValueError:
        return None


def fleet_of(cluster: Cluster) -> Fleet:
    busy = {m.host for m in cluster.all_members if m.host and m.role in ROLES}  # a host's agent stays
    busy |= {host for host, node in cluster.nodes.items() if node.daemons}
    return Fleet(nodes={h: dict(n.labels) for h, n in cluster.nodes.items()},
                 gpus={h: len(n.gpus) for h, n in cluster.nodes.items()}, admissions=dict(cluster.admissions),
                 node_states=dict(cluster.node_states), busy_hosts=frozenset(busy))


class ResourceManager(Daemon):
    role = "resource-manager"

    def setup(self) -> None:
        self._waiting: dict[str, str] = {}  # hosts not admitted, and why (logged when it changes)
        self._paused = False

    def cycle(self) -> str | None:
        # Every cycle while leader: one range read of the job; writes only what changed.
        return self.reconcile() if self.is_leader else None

    def reload(self, spec: JobSpec) -> str:
        self.spec = spec
        return "reloaded spec; " + ((self.reconcile() or "placement unchanged") if self.is_leader else "standby")

    def member_info(self) -> dict:
        return {"waiting_hosts": dict(self._waiting)} if self._waiting else {}

    def reconcile(self) -> str | None:
        """Make placement, admissions and drains match the spec and the operator's intent;
        says what changed."""
        assert self.spec is not None
        try:
            cluster = Cluster.read(self.store, self.options.job)
            if cluster.paused:
                if not self._paused:
                    self._paused = True
                    return "job paused: placement kept as it is"
                return None
            self._paused = False
            decision = decide(self.spec, fleet_of(cluster), time.time())
            said = self._apply(cluster, decision)
        except StoreUnavailable as exc:
            return f"placement not reconciled (etcd unreachable: {exc})"
        if decision.waiting != self._waiting:
            for host, why in decision.waiting.items():
                if self._waiting.get(host) != why:
                    log.info("host %s not admitted: %s", host, why, extra={"event": "not_admitted", "host": host})
            self._waiting = dict(decision.waiting)
        return "; ".join(said) or None

    def _apply(self, cluster: Cluster, decision: Decision) -> list[str]:
        said = []
        for admission in decision.admit:
            self.store.put(self.keys.admitted(admission.host), admission.to_value())
            said.append(f"admitted {admission.host} into pool {admission.pool} "
                        f"(labels {describe_labels(admission.labels or {})})")
        desired = {self.keys.placement(p.host, p.role, p.member_id): Placement(p.host, p.role, p.member_id, gpus=p.gpus)
                   for p in decision.placed}
        # Read raw: a key under placement/ that names no daemon is not desired, so it goes.
        current = {kv.key: _placed(self.keys, kv) for kv in self.store.get_prefix(self.keys.placement_prefix)}
        added = [k for k, p in desired.items() if current.get(k) != p]
        removed = [k for k in current if k not in desired]
        now = time.time()
        for key in added:  # `since`: when it was placed (`rlfleet node add` reports phases from it)
            self.store.put(key, replace(desired[key], since=now).to_value())
        for key in removed:
            self.store.delete(key)
        if added or removed:
            said.append(f"placement reconciled: {len(added)} added, {len(removed)} removed, {len(desired)} placed")
        for host in decision.forget:
            self.store.delete(self.keys.admitted(host))
            said.append(f"forgot the admission of {host}")
        for host in decision.drained:
            state = cluster.node_states[host]
            # Only if nobody changed the intent since we read it (an uncordon wins).
            value = {**state.to_value(), "state": DRAINED, "since": time.time()}
            if self.store.compare_and_swap(self.keys.node_state(host), state.mod_revision, value):
                said.append(f"{host} drained: nothing of the job runs there")
        return said
