"""The resource-manager daemon.

Every instance records the inventory of its own machine under
/rlfleet/<job>/nodes/<host> (bound to its lease, so a machine whose manager
died drops out). The elected leader also reconciles
/rlfleet/<job>/placement/... with the spec: what should run where.
"""

from __future__ import annotations

from rlfleet.common.daemon import Daemon
from rlfleet.common.placement import placement_from_spec
from rlfleet.common.spec import JobSpec
from rlfleet.daemons.resource_manager.inventory import machine_inventory

RECONCILE_EVERY_CYCLES = 10


class ResourceManager(Daemon):
    role = "resource-manager"

    def setup(self) -> None:
        assert self.session is not None
        self.inventory = machine_inventory(self.options.host)
        self.session.put_lease_bound(self.keys.node(self.options.host), self.inventory)
        self._was_leader = False

    def cycle(self) -> str | None:
        became_leader = self.is_leader and not self._was_leader
        self._was_leader = self.is_leader
        if self.is_leader and (became_leader or self.cycles % RECONCILE_EVERY_CYCLES == 0):
            return self.reconcile_placement()
        return None

    def reload(self, spec: JobSpec) -> str:
        self.spec = spec
        return "reloaded spec; " + (self.reconcile_placement() if self.is_leader else "standby")

    def reconcile_placement(self) -> str:
        """Make the placement keys equal the spec's placement; says what changed."""
        from rlfleet.common.store import StoreUnavailable
        assert self.spec is not None
        desired = {self.keys.placement(p.host, p.role, p.member_id): {"host": p.host, "role": p.role, "id": p.member_id}
                   for p in placement_from_spec(self.spec)}
        try:
            current = {kv.key: kv.value for kv in self.store.get_prefix(self.keys.placement_prefix)}
            added = [k for k, v in desired.items() if current.get(k) != v]
            removed = [k for k in current if k not in desired]
            for key in added:
                self.store.put(key, desired[key])
            for key in removed:
                self.store.delete(key)
        except StoreUnavailable as exc:
            return f"placement not reconciled (etcd unreachable: {exc})"
        if added or removed:
            return f"placement reconciled: {len(added)} added, {len(removed)} removed, {len(desired)} placed"
        return None  # type: ignore[return-value]
