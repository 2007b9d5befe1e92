"""Prometheus metrics every daemon exports, and the HTTP endpoint that serves them.

Metrics are pulled by Prometheus from each daemon; nothing per-second goes
through etcd (ARCHITECTURE §2). The endpoint address is published in the
daemon's member registration so a scraper can discover it.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

UP = Gauge("rlfleet_up", "1 while the daemon's main loop runs", ["role", "id"])
DEGRADED = Gauge("rlfleet_degraded", "1 while etcd is unreachable from this daemon", ["role", "id"])
IS_LEADER = Gauge("rlfleet_is_leader", "1 while this daemon holds its role's leadership", ["role", "id"])
CYCLES = Counter("rlfleet_cycles_total", "Main-loop cycles run", ["role", "id"])
LEASE_GRANTS = Counter("rlfleet_lease_grants_total", "Leases granted (1 + re-registrations)", ["role", "id"])
CYCLE_SECONDS = Histogram("rlfleet_cycle_seconds", "Duration of one main-loop cycle", ["role", "id"],
                          buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 1, 2, 5))
# Every message a receiver refused, whatever the reason: undecodable frames (wire.py
# REJECT_REASONS), hostile content (validation.py) and messages whose handler raised
# ("handler_error"). `endpoint` is the receiving socket's name.
REJECTED_MESSAGES = Counter("rlfleet_rejected_messages_total",
                            "Messages a daemon rejected and served on, by endpoint and kind",
                            ["role", "endpoint", "kind"])

_process_role = ""  # the daemon's role, set once by Daemon (a label of REJECTED_MESSAGES)


def set_role(role: str) -> None:
    global _process_role
    _process_role = role


def process_role() -> str:
    return _process_role


def serve_metrics(host: str = "127.0.0.1", port: int = 0) -> str:
    """Start the /metrics HTTP endpoint (port 0: any free port); returns its URL."""
    server, _thread = start_http_server(port, addr=host)
    return f"http://{host}:{server.server_port}/metrics"
