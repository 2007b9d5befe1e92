"""The repack-manager daemon (leader-elected).

For now it collects every live rollout's statistics (running and waiting
requests, KV-cache usage, tokens/s, weight version) and exposes them: as
Prometheus gauges, as a summary in its member registration, and as a JSON
line per poll in `<run dir>/rollout_stats.jsonl`. After each poll the planner of
`[repack_manager.planner]` (planners.py) sees that view; the default, `none`, plans
nothing. The repack algorithm (Laminar §5: KV-cache idleness, Algorithm 1) comes
as a planner kind, with the execution of its moves, later.
Only the leader polls; standbys wait.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from prometheus_client import Gauge

from rlfleet.common.daemon import Daemon
from rlfleet.common.members import members_from
from rlfleet.common.run_dir import job_run_dir
from rlfleet.common.seams import REPACK_PLANNERS
from rlfleet.common.sockets import PeerTimeout, RequestClient
from rlfleet.common.store import StoreUnavailable
from rlfleet.common.wire import RolloutStats

log = logging.getLogger("rlfleet.repack")

POLL_EVERY_S = 1.0
POLL_TIMEOUT_S = 1.0

KV_USED = Gauge("rlfleet_rollout_kv_used", "KV-cache slots/tokens in use, per rollout", ["rollout"])
KV_TOTAL = Gauge("rlfleet_rollout_kv_total", "KV-cache capacity, per rollout", ["rollout"])
RUNNING = Gauge("rlfleet_rollout_running", "Running requests, per rollout", ["rollout"])
ROLLOUT_VERSION = Gauge("rlfleet_rollout_weight_version", "Weight version loaded, per rollout", ["rollout"])


class RepackManager(Daemon):
    role = "repack-manager"

    def setup(self) -> None:
        self.latest: dict[str, RolloutStats] = {}
        self._rollouts: dict[str, str] = {}  # rollout id -> requests address
        self._lock = threading.Lock()
        self._stats_path = job_run_dir(self.spec) / "rollout_stats.jsonl"
        self.planner = REPACK_PLANNERS.build(self.spec.repack_manager.planner)
        self.last_plan: list[Any] = []
        self._poller = threading.Thread(target=self._poll_loop, name="stats-poller", daemon=True)
        self._poller.start()

    def cycle(self) -> str | None:
        if not self.is_leader:
            return None
        try:
            members = members_from(self.keys, self.store.get_prefix(self.keys.role_members_prefix("rollout")))
        except StoreUnavailable:
            return None  # the session already reported etcd as unreachable
        found = {m.id: m.address("requests") for m in members}
        with self._lock:
            changed = found != self._rollouts
            self._rollouts = {k: v for k, v in found.items() if v}
        return f"watching {len(self._rollouts)} rollouts" if changed else None

    def member_info(self) -> dict[str, Any]:
        with self._lock:
            stats = dict(self.latest)
        return {"rollouts": len(stats),
                "versions": sorted({s.weight_version for s in stats.values()})}

    def _poll_loop(self) -> None:
        clients: dict[str, RequestClient] = {}
        while not self._stop.is_set():
            started = time.monotonic()
            with self._lock:
                targets = dict(self._rollouts) if self.is_leader else {}
            for gone in set(clients) - set(targets):
                clients.pop(gone).close()
            lines = []
            for rollout_id, address in targets.items():
                client = clients.get(rollout_id)
                if client is None or client.address != address:
                    if client is not None:
                        client.close()
                    client = clients[rollout_id] = RequestClient(address, expect=RolloutStats)
                try:
                    stats = client.request(RolloutStats(rollout_id, 0, 0, 0, 0, 0, 0.0, 0.0), POLL_TIMEOUT_S)
                except PeerTimeout:
                    continue  # a busy or dead rollout: the lease tells which
                with self._lock:
                    self.latest[rollout_id] = stats
                KV_USED.labels(rollout_id).set(stats.kv_used)
                KV_TOTAL.labels(rollout_id).set(stats.kv_total)
                RUNNING.labels(rollout_id).set(stats.running)
                ROLLOUT_VERSION.labels(rollout_id).set(stats.weight_version)
                lines.append({"time": round(time.time(), 3), "rollout": rollout_id, "version": stats.weight_version,
                              "running": stats.running, "waiting": stats.waiting, "kv_used": stats.kv_used,
                              "kv_total": stats.kv_total, "tokens_per_s": stats.tokens_per_s})
            if lines:
                with self._lock:
                    latest = {rid: self.latest[rid] for rid in targets if rid in self.latest}
                self.last_plan = self.planner.plan(latest)
                if self.last_plan:  # nothing executes a plan yet: say what it would have done
                    log.info("planned %d repack move(s): %s (not executed)", len(self.last_plan),
                             self.last_plan, extra={"event": "repack_plan"})
                self._stats_path.parent.mkdir(parents=True, exist_ok=True)
                with open(self._stats_path, "a") as f:
                    f.writelines(json.dumps(line) + "\n" for line in lines)
            self._stop.wait(max(0.0, POLL_EVERY_S - (time.monotonic() - started)))
        for client in clients.values():
            client.close()
