"""The agent's HTTP endpoint: `/metrics` (its own Prometheus metrics) and `/targets`
(Prometheus HTTP service discovery: the metrics endpoints of the daemons
registered from this host, so one scrape config per host finds them all).
Served by waitress with the settings of every daemon's /metrics (common/metrics.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import make_wsgi_app

from rlfleet.common.control.members import Member
from rlfleet.common.metrics import Endpoint, serve_wsgi


def http_sd_groups(job: str, host: str, members: Iterable[Member]) -> list[dict]:
    """One target group per daemon of `host` with a metrics URL: `ip:port` and labels
    job, host, role, id. The agents themselves are left out: Prometheus scrapes each
    agent through its own job (the address is known from the inventory)."""
    groups = []
    for m in sorted(members, key=lambda m: (m.role, m.id)):
        if m.host != host or m.role == "agent" or not m.metrics:
            continue
        netloc = urlsplit(m.metrics).netloc
        if netloc:
            groups.append({"targets": [netloc], "labels": {"job": job, "host": host, "role": m.role, "id": m.id}})
    return groups


def app(targets: Callable[[], list[dict]]) -> Callable[..., Iterable[bytes]]:
    """The WSGI app: /metrics (prometheus_client's), /targets (``targets()`` as JSON),
    404 elsewhere."""
    metrics = make_wsgi_app()

    def answer(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics(environ, start_response)
        if path == "/targets":
            status, kind, body = "200 OK", "application/json", json.dumps(targets()).encode()
        else:
            status, kind, body = "404 Not Found", "text/plain", b"not found: try /metrics or /targets\n"
        start_response(status, [("Content-Type", kind), ("Content-Length", str(len(body)))])
        return [body]

    return answer


def serve(host: str, port: int, targets: Callable[[], list[dict]]) -> Endpoint:
    """Start the endpoint in a daemon thread; `targets()` gives the /targets document
    (the agent's last read, so a scrape never waits on etcd)."""
    return serve_wsgi(app(targets), host, port, "agent-http")
