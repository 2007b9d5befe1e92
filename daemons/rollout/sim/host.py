"""Many simulated rollouts in one process and one thread (ARCHITECTURE §6).

A rollout daemon whose engine is ``sim`` with ``rollouts = N`` hosts N simulated
rollouts. Each is a full rollout to the rest of the fleet: its own member
(``members/rollout/<daemon id>-<k>``, bound to the daemon's lease, so killing the
process is a machine failure for all of them), its own ``requests`` socket, engine,
weight version, statistics and repack orders (``core.RolloutCore``). The daemon's own
member record carries no ``requests`` address: nobody routes to the host itself.

One thread serves them all: it polls every socket, hands messages to their cores, and
sleeps until the earliest engine event (``SimEngine.next_event_at``) or the next weight
check. The relay's newest version is read once per check for all of them, through the
reader the ``rollout-relay`` thread keeps (relay_source.py: this thread never reads
etcd). Each engine measures how late its results leave against its timing model (its
lag); a figure taken while that lag was above 5 % is not kept (tools/bench/longtail.py).
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import zmq

from rlfleet.common.threads import LoopThread
from rlfleet.common.wire.sockets import RequestServer, shared_context
from rlfleet.daemons.rollout.core import ReaderSource, RolloutCore, WeightReader

log = logging.getLogger("rlfleet.rollout")

SUMMARY_EVERY_S = 2.0


def sim_member_id(host_id: str, index: int, count: int) -> str:
    return f"{host_id}-{index:0{max(2, len(str(count - 1)))}d}"


class SimHost(LoopThread):
    def __init__(self, cores: list[RolloutCore], servers: list[RequestServer], weights: ReaderSource | None,
                 *, check_every_s: float = 0.05, summary_path: Path | None = None,
                 drain_timeout_s: float = 2.0) -> None:
        super().__init__("sim-host")
        self.cores, self.servers = cores, servers  # core i answers on servers[i]
        self.weights = weights  # None: every engine serves version 0 for good
        self.check_every_s = check_every_s
        self.summary_path = summary_path
        self.drain_timeout_s = drain_timeout_s
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self._by_socket = {server.sock: i for i, server in enumerate(servers)}
        self._heap: list[tuple[float, int]] = []  # (engine's next event, core index)
        self._due: dict[int, float] = {}

    def release(self) -> None:
        for core in self.cores:
            core.release()

    # -- the thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            poller = zmq.Poller()
            for server in self.servers:
                poller.register(server.sock, zmq.POLLIN)
            next_check = next_summary = 0.0
            newest: int | None = None
            while not self._stop.is_set():
                now = time.monotonic()
                wake = min(next_check, self._heap[0][0] if self._heap else next_check)
                ready = poller.poll(max(0, int((wake - now) * 1000 + 0.999)))
                dirty: set[int] = set()
                for sock, _ in ready:
                    i = self._by_socket[sock]
                    self._receive(i)
                    dirty.add(i)
                now = time.monotonic()
                reader = self.weights.get(now) if self.weights is not None else None
                if now >= next_check:
                    next_check = now + self.check_every_s
                    newest = self._newest(reader)
                    for i, core in enumerate(self.cores):
                        if core.held or (newest is not None and newest > core.engine.weight_version):
                            dirty.add(i)
                while self._heap and self._heap[0][0] <= now:
                    _, i = heapq.heappop(self._heap)
                    dirty.add(i)
                for i in dirty:
                    self.cores[i].tick(now, reader, newest)
                    self._send(i)
                    self._schedule(i)
                if now >= next_summary:
                    next_summary = now + SUMMARY_EVERY_S
                    self.write_summary()
            self._drain()
        except BaseException as exc:  # a bug: the daemon's cycle() sees it and exits
            log.exception("sim host thread died")
            self.error = exc
        finally:
            self.write_summary()

    def _receive(self, i: int, max_messages: int = 1000) -> None:
        for _ in range(max_messages):  # bounded: a flood must not starve the others
            got = self.servers[i].recv(0.0)
            if got is None:
                return
            identity, rid, msg = got
            self.cores[i].on_message(identity, rid, msg, time.monotonic())
            self._send(i)

    def _send(self, i: int) -> None:
        for identity, rid, msg in self.cores[i].take_replies():
            self.servers[i].reply(identity, rid, msg)

    def _schedule(self, i: int) -> None:
        at = self.cores[i].engine.next_event_at()  # type: ignore[attr-defined]
        if at is not None and self._due.get(i) != at:
            self._due[i] = at
            heapq.heappush(self._heap, (at, i))

    def _newest(self, reader: WeightReader | None) -> int | None:
        if reader is None:
            return None
        try:
            return reader.newest()
        except Exception as exc:  # noqa: BLE001 — keep serving the versions held
            log.warning("weight reader newest() failed: %s", exc)
            return None

    def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        for i, core in enumerate(self.cores):
            core.refuse_held()
            self._send(i)
        while time.monotonic() < deadline and any(c.engine.has_work() for c in self.cores):
            for i, core in enumerate(self.cores):
                self._receive(i)
                core.tick(time.monotonic(), None)
                self._send(i)
            time.sleep(0.001)
        for i, core in enumerate(self.cores):
            self._receive(i)
            core.cut(list(core.clients), "rollout is draining")
            self._send(i)

    # -- what the benchmark reads ------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Cumulative figures per simulated rollout since it started (elapsed_s): tokens
        generated (aborted ones too), seconds with nothing running, the integral of
        KV utilisation (kv_used / kv_total) over time, and its lag against the model."""
        elapsed = time.monotonic() - self.started
        out = {}
        for core in self.cores:
            e: Any = core.engine
            out[core.member_id] = {
                "weight_version": e.weight_version, "generated_tokens": int(e.generated_tokens),
                "idle_s": round(e.idle_s, 4), "kv_util_s": round(e.kv_utilization_mean() * elapsed, 4),
                "lag": round(e.lag_fraction(), 5)}
        return {"time": time.time(), "elapsed_s": round(elapsed, 4), "rollouts": out}

    def write_summary(self) -> None:
        """``<run dir>/sim/<id>.json`` (the latest, per rollout) and one aggregate line per
        call in ``<id>.jsonl`` (a time series: rates over any window)."""
        if self.summary_path is None:
            return
        try:
            s = self.summary()
            rollouts = s["rollouts"].values()
            line = {"time": round(s["time"], 3), "elapsed_s": s["elapsed_s"], "rollouts": len(rollouts),
                    "generated_tokens": sum(r["generated_tokens"] for r in rollouts),
                    "idle_s": round(sum(r["idle_s"] for r in rollouts), 3),
                    "kv_util_s": round(sum(r["kv_util_s"] for r in rollouts), 3),
                    "max_lag": max((r["lag"] for r in rollouts), default=0.0)}
            self.summary_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.summary_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(s))
            os.replace(tmp, self.summary_path)
            with open(self.summary_path.with_suffix(".jsonl"), "a") as f:
                f.write(json.dumps(line) + "\n")
        except Exception as exc:  # noqa: BLE001 — statistics must never stop serving
            log.warning("cannot write %s: %s", self.summary_path, exc)


def bind_servers(count: int, bind_host: str, host_id: str, expect: tuple[type, ...]) -> list[RequestServer]:
    ctx = shared_context()
    return [RequestServer(f"tcp://{bind_host}:0", expect=expect, ctx=ctx,
                          name=f"{sim_member_id(host_id, k, count)}-requests", edge="rollout-requests")
            for k in range(count)]
