"""The agent's HTTP endpoint: `/metrics` (its own Prometheus metrics) and `/targets`
(Prometheus HTTP service discovery: the metrics endpoints of the daemons
registered from this host, so one scrape config per host finds them all).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from rlfleet.common.members import Member


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


def serve(host: str, port: int, targets: Callable[[], list[dict]]) -> ThreadingHTTPServer:
    """Start the endpoint in a daemon thread; `targets()` gives the /targets document
    (the agent's last read, so a scrape never waits on etcd)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 — the http.server spelling
            path = urlsplit(self.path).path
            if path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(REGISTRY))
            elif path == "/targets":
                self._send(200, "application/json", json.dumps(targets()).encode())
            else:
                self._send(404, "text/plain", b"not found: try /metrics or /targets\n")

        def _send(self, code: int, kind: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:  # a scrape every few seconds is not news
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="agent-http", daemon=True).start()
    return server
