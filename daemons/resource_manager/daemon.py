"""The resource-manager daemon.

The elected leader reconciles `placement/...` with the spec: what should run
where. Standbys wait. The node agents (daemons/agent/) act on that placement
and record each machine's inventory under `nodes/<host>`.
"""

from __future__ import annotations

from rlfleet.common.daemon import Daemon
from rlfleet.common.keys import JobKeys
from rlfleet.common.members import Placement
from rlfleet.common.placement import placement_from_spec
from rlfleet.common.spec import JobSpec
from rlfleet.common.store import KeyValue

RECONCILE_EVERY_CYCLES = 10


def _placed(keys: JobKeys, kv: KeyValue) -> Placement | None:
    """The placement record, or None for a key under placement/ that names no daemon
    (it is not desired, so reconciling deletes it)."""
    try:
        return Placement.from_kv(keys, kv)
    except ValueError:
        return None


class ResourceManager(Daemon):
    role = "resource-manager"

    def setup(self) -> None:
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
        desired = {self.keys.placement(p.host, p.role, p.member_id): Placement(p.host, p.role, p.member_id)
                   for p in placement_from_spec(self.spec)}
        try:
            current = {kv.key: _placed(self.keys, kv) for kv in self.store.get_prefix(self.keys.placement_prefix)}
            added = [k for k, p in desired.items() if current.get(k) != p]  # a malformed value is rewritten
            removed = [k for k in current if k not in desired]
            for key in added:
                self.store.put(key, desired[key].to_value())
            for key in removed:
                self.store.delete(key)
        except StoreUnavailable as exc:
            return f"placement not reconciled (etcd unreachable: {exc})"
        if added or removed:
            return f"placement reconciled: {len(added)} added, {len(removed)} removed, {len(desired)} placed"
        return None  # type: ignore[return-value]
