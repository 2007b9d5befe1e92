"""The repack-manager daemon (leader-elected): Laminar §5's rollout manager.

Only the leader works; standbys wait. Its poller thread, every POLL_EVERY_S:

    ask every live rollout for its RolloutStats (all at once, one timeout)
    -> check them (rollout_view.py: impossible values and unknown rollouts are rejected,
       counted in metrics, never planned on)
    -> when due (every ``interval_s`` of [repack_manager.planner], and right after each
       new weights/latest version) ask the planner (planners.py, pure) for a plan
    -> write the plan to etcd (``repack/plan``: id, moves, state) and execute it: each
       source gets a RepackOrder naming its destination; it ends its running generations
       as "abort" with ``continue_on`` = the destination, and the env-hosts continue them
       there on the same version; the emptied source pulls the newest weights.

Orders carry ids (``<plan id>-<n>``) and a rollout answers a repeated order with its
first answer, so re-sending a plan is harmless: a new leader finding a plan still
"executing" in etcd sends its orders again. Everything it sees is also exposed as
Prometheus gauges and a JSON line per poll in ``<run dir>/rollout_stats.jsonl`` (the
plans in ``repack_plans.jsonl``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

from prometheus_client import Counter, Gauge

from rlfleet.common import failpoints
from rlfleet.common.control.members import members_from
from rlfleet.common.control.records import RepackPlan, WeightsLatest
from rlfleet.common.control.store import StoreUnavailable
from rlfleet.common.daemon import Daemon
from rlfleet.common.spec.run_dir import job_run_dir
from rlfleet.common.spec.seams import REPACK_PLANNERS
from rlfleet.common.wire.messages import Ack, RepackOrder, RolloutStats
from rlfleet.common.wire.sockets import PeerTimeout, RequestClient

from .rollout_view import check_stats, engine_batch_limit

log = logging.getLogger("rlfleet.repack")

POLL_EVERY_S = 1.0
POLL_TIMEOUT_S = 1.0
ORDER_TIMEOUT_S = 2.0

KV_USED = Gauge("rlfleet_rollout_kv_used", "KV-cache slots/tokens in use, per rollout", ["rollout"])
KV_TOTAL = Gauge("rlfleet_rollout_kv_total", "KV-cache capacity, per rollout", ["rollout"])
RUNNING = Gauge("rlfleet_rollout_running", "Running requests, per rollout", ["rollout"])
ROLLOUT_VERSION = Gauge("rlfleet_rollout_weight_version", "Weight version loaded, per rollout", ["rollout"])
STATS_REJECTED = Counter("rlfleet_repack_stats_rejected_total", "Rollout statistics refused", ["reason"])
PLANS = Counter("rlfleet_repack_plans_total", "Repack plans with at least one move")
MOVES = Counter("rlfleet_repack_moves_total", "Repack orders, by outcome", ["outcome"])
MOVED_REQUESTS = Counter("rlfleet_repack_moved_requests_total", "Generations handed over by repacks")
PLAN_SECONDS = Gauge("rlfleet_repack_plan_seconds", "Time the planner took for the last plan")


class RepackManager(Daemon):
    role = "repack-manager"

    def setup(self) -> None:
        assert self.spec is not None
        self.latest: dict[str, RolloutStats] = {}
        self._rollouts: dict[str, str] = {}  # rollout id -> requests address
        self._lock = threading.Lock()
        run_dir = job_run_dir(self.spec)
        self._stats_path = run_dir / "rollout_stats.jsonl"
        self._plans_path = run_dir / "repack_plans.jsonl"
        config = self.spec.repack_manager.planner
        self.planner = REPACK_PLANNERS.build(config)
        self.interval_s = float(getattr(config, "interval_s", 5.0))
        self.last_plan: Any = None
        self.plans = 0
        self._previous: dict[str, Any] = {}  # rollout id -> its load at the previous poll
        self._published = -1  # the weights/latest version last seen
        self.rejected = 0  # stats replies refused (impossible values, unknown rollouts)
        self._said_rejected: set[str] = set()
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
            found = {k: v for k, v in found.items() if v}
            changed = found != self._rollouts
            self._rollouts = found
        return f"watching {len(found)} rollouts" if changed else None

    def member_info(self) -> dict[str, Any]:
        with self._lock:
            stats = dict(self.latest)
        return {"rollouts": len(stats), "plans": self.plans, "stats_rejected": self.rejected,
                "versions": sorted({s.weight_version for s in stats.values()})}

    # -- the poller thread: stats -> plan -> orders ----------------------------------------
    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._poll_forever()
                return
            except Exception:  # noqa: BLE001 — the poller must outlive any surprise
                log.exception("repack poller failed; starting it again in 1 s",
                              extra={"event": "poller_error"})
                self._stop.wait(1.0)

    def _poll_forever(self) -> None:
        clients: dict[str, RequestClient] = {}
        next_plan = time.monotonic() + self.interval_s
        resumed = False
        while not self._stop.is_set():
            started = time.monotonic()
            with self._lock:
                targets = dict(self._rollouts) if self.is_leader else {}
            for gone in set(clients) - set(targets):
                clients.pop(gone).close()
            for rollout_id, address in targets.items():
                client = clients.get(rollout_id)
                if client is None or client.address != address:
                    if client is not None:
                        client.close()
                    clients[rollout_id] = RequestClient(address, expect=(RolloutStats, Ack))
            if targets and not resumed:
                resumed = True
                self._resume_plan(clients)
            replies = self._gather_stats(clients, targets)
            if replies:
                limit = engine_batch_limit(self.spec.rollout.engine)  # type: ignore[union-attr]
                loads, rejected = check_stats(replies, set(targets),
                                              {r: limit for r in targets} if limit else None)
                for rejection in rejected:
                    STATS_REJECTED.labels(reason=rejection.code).inc()
                    if rejection.code not in self._said_rejected:  # logged once per kind
                        self._said_rejected.add(rejection.code)
                        log.warning("statistics refused (%s), not planned on: %s", rejection.code,
                                    rejection, extra={"event": "stats_rejected"})
                self.rejected += len(rejected)
                published = self._published_version()
                due = started >= next_plan or published > self._published
                if due:
                    next_plan = started + self.interval_s
                    self._published = max(self._published, published)
                    self._plan_and_execute(loads, clients)
                    # C_prev is the load at the previous planning round, not the previous
                    # poll: running requests grow the KV a little every step, so over one
                    # poll a ramp-down shows only when a request happens to finish; over an
                    # interval (Laminar: 5 s) the finished ones outweigh the growth.
                    # A rollout that did not answer keeps its last load.
                    self._previous.update(loads)
            self._stop.wait(max(0.0, POLL_EVERY_S - (time.monotonic() - started)))
        for client in clients.values():
            client.close()

    def _gather_stats(self, clients: Mapping[str, RequestClient],
                      targets: Mapping[str, str]) -> dict[str, RolloutStats]:
        """Ask every rollout at once; those that do not answer in POLL_TIMEOUT_S are
        left out (a busy or dead rollout: the lease tells which)."""
        asked: dict[tuple[str, str], str] = {}
        for rollout_id in targets:
            try:
                rid = clients[rollout_id].send(RolloutStats.poll(rollout_id), 0.1)
            except PeerTimeout:
                continue
            asked[(rollout_id, rid)] = rollout_id
        got: dict[str, RolloutStats] = {}
        deadline = time.monotonic() + POLL_TIMEOUT_S
        waiting = {rid: rollout_id for (rollout_id, rid) in asked}
        while waiting and time.monotonic() < deadline:
            for rollout_id in set(waiting.values()):
                for rid, msg in clients[rollout_id].poll_replies(0.0):
                    if waiting.pop(rid, None) is not None and isinstance(msg, RolloutStats):
                        got[rollout_id] = msg
            if waiting:
                time.sleep(0.002)
        for rid, rollout_id in waiting.items():
            clients[rollout_id].cancel(rid)
        lines = []
        for rollout_id, stats in got.items():
            KV_USED.labels(rollout_id).set(stats.kv_used)
            KV_TOTAL.labels(rollout_id).set(stats.kv_total)
            RUNNING.labels(rollout_id).set(stats.running)
            ROLLOUT_VERSION.labels(rollout_id).set(stats.weight_version)
            lines.append({"time": round(time.time(), 3), "rollout": rollout_id, "version": stats.weight_version,
                          "running": stats.running, "waiting": stats.waiting, "kv_used": stats.kv_used,
                          "kv_total": stats.kv_total, "tokens_per_s": stats.tokens_per_s})
        with self._lock:
            self.latest.update(got)
        if lines:
            self._append(self._stats_path, lines)
        return got

    def _published_version(self) -> int:
        try:
            latest = WeightsLatest.read(self.store, self.keys)
        except StoreUnavailable:
            return self._published
        return self._published if latest is None else latest.version

    def _plan_and_execute(self, loads: Mapping[str, Any], clients: Mapping[str, RequestClient]) -> None:
        started = time.perf_counter()
        plan = self.planner.plan(loads, self._previous)
        plan_s = time.perf_counter() - started
        PLAN_SECONDS.set(plan_s)
        moves = list(getattr(plan, "moves", plan) or [])
        if not moves:
            return
        self.plans += 1
        PLANS.inc()
        plan_id = str(getattr(plan, "id", "") or f"{self.options.member_id}-{self.plans}")
        record = {"id": plan_id, "state": "executing", "time": round(time.time(), 3),
                  "moves": [[m.source, m.destination] for m in moves], "plan_ms": round(plan_s * 1000, 3)}
        try:
            self.store.put(self.keys.repack_plan, record)
        except StoreUnavailable:
            log.warning("repack plan %s not recorded in etcd (unreachable); executing anyway", plan_id)
        outcomes = self._execute(plan_id, record["moves"], clients)
        self._failpoint_mid_plan()
        record.update(state="done", outcomes=outcomes, done=round(time.time(), 3))
        try:
            self.store.put(self.keys.repack_plan, record)
        except StoreUnavailable:
            pass
        self.last_plan = record
        self._append(self._plans_path, [record])
        moved = sum(o.get("moved", 0) for o in outcomes)
        log.info("repack plan %s: %d move(s), %d generation(s) handed over, planned in %.1f ms",
                 plan_id, len(moves), moved, plan_s * 1000, extra={"event": "repack_plan"})

    def _execute(self, plan_id: str, moves: list[list[str]],
                 clients: Mapping[str, RequestClient]) -> list[dict[str, Any]]:
        """Send every order, then collect the acks (one timeout for all)."""
        sent: dict[str, tuple[int, str]] = {}  # socket request id -> (move index, source)
        outcomes: list[dict[str, Any]] = [{"order": f"{plan_id}-{i}", "source": s, "destination": d,
                                           "outcome": "no answer"} for i, (s, d) in enumerate(moves)]
        for i, (source, destination) in enumerate(moves):
            client = clients.get(source)
            if client is None:
                outcomes[i]["outcome"] = "source gone"
                continue
            try:
                rid = client.send(RepackOrder(f"{plan_id}-{i}", source, destination, []), 0.1)
            except PeerTimeout:
                outcomes[i]["outcome"] = "source unreachable"
                continue
            sent[rid] = (i, source)
        deadline = time.monotonic() + ORDER_TIMEOUT_S
        while sent and time.monotonic() < deadline:
            for source in {s for _, s in sent.values()}:
                for rid, msg in clients[source].poll_replies(0.0):
                    i, _ = sent.pop(rid, (None, None))
                    if i is None or not isinstance(msg, Ack):
                        continue
                    moved = max(0, len(msg.ids) - 1)
                    outcomes[i].update(outcome="done" if msg.ok else f"refused: {msg.error}", moved=moved)
                    MOVED_REQUESTS.inc(moved)
            if sent:
                time.sleep(0.002)
        for rid, (_, source) in sent.items():
            clients[source].cancel(rid)
        for o in outcomes:
            MOVES.labels(outcome=o["outcome"].split(":")[0]).inc()
        return outcomes

    def _failpoint_mid_plan(self) -> None:
        """Tests: RLFLEET_REPACK_FAILPOINT=kill_mid_plan kills this process (SIGKILL) once per
        run, after a plan's orders went out and before it is recorded done."""
        if not failpoints.repack_kills_mid_plan():
            return
        marker = job_run_dir(self.spec) / "repack-failpoint-fired"  # type: ignore[arg-type]
        if marker.exists():
            return
        marker.write_text(str(os.getpid()))
        log.warning("failpoint: killing the repack-manager mid-plan", extra={"event": "failpoint"})
        os.kill(os.getpid(), signal.SIGKILL)

    def _resume_plan(self, clients: Mapping[str, RequestClient]) -> None:
        """A plan a previous leader left "executing": send its orders again (idempotent)."""
        try:
            plan = RepackPlan.read(self.store, self.keys)
        except StoreUnavailable:
            return
        if plan is None or plan.problem or plan.state != "executing":
            return
        log.info("resuming repack plan %s left executing by the previous leader", plan.id,
                 extra={"event": "repack_resume"})
        outcomes = self._execute(plan.id, [list(m) for m in plan.moves], clients)
        record = {**plan.to_value(), "state": "done", "outcomes": outcomes,
                  "done": round(time.time(), 3), "resumed": True}
        self._append(self._plans_path, [record])
        try:
            self.store.put(self.keys.repack_plan, record)
        except StoreUnavailable:
            pass

    def _append(self, path: Any, lines: list[dict[str, Any]]) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.writelines(json.dumps(line) + "\n" for line in lines)
        except OSError as exc:
            log.warning("cannot append to %s: %s", path, exc)
