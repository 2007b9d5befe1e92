"""Prometheus metrics every daemon exports, and the HTTP endpoint that serves them.

Metrics are pulled by Prometheus from each daemon; nothing per-second goes
through etcd (ARCHITECTURE §2). The endpoint address is published in the
daemon's member registration so a scraper can discover it. It is served by waitress
(``serve_wsgi``): one loop thread holds every connection, two threads answer, so idle
or slow clients cannot make the daemon start a thread each.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass
from typing import Any

import waitress
from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app
from waitress import wasyncore
from waitress.server import BaseWSGIServer

from rlfleet.common.log_throttle import LogThrottle

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


# waitress's settings for every daemon's HTTP endpoint (/metrics; the agent's /targets).
# Its clients are one or two Prometheus servers and an operator's curl.
HTTP_SETTINGS: dict[str, Any] = {
    # Threads that run the app; connections never take one (the loop thread reads
    # requests and writes answers for all). A scrape renders in milliseconds: two let an
    # HA Prometheus pair scrape at once; more requests wait in waitress's queue.
    "threads": 2,
    # Open connections, the listening socket and waitress's wake-up pipe included. At the
    # limit waitress stops accepting and newcomers wait in the kernel's backlog until
    # channel_timeout frees places (no eviction). 256 file descriptors are little beside
    # the units' LimitNOFILE=65536, and a stuck client would have to open 50 a second
    # to fill them within channel_timeout.
    "connection_limit": 256,
    # Seconds a connection may stay idle (no request in progress, nothing read or sent)
    # before it is closed: a client that connects and says nothing (a port scanner, a
    # stuck scraper) holds a file descriptor this long. A request being answered is not
    # idle; Prometheus (scraping every 15 s or so) just reconnects when its keep-alive
    # connection was closed in between.
    "channel_timeout": 5,
    # Seconds between the sweeps that close idle connections (a walk over at most
    # connection_limit of them): an idle one is closed between channel_timeout and
    # channel_timeout + cleanup_interval + 1 s (the loop's poll timeout) after it went quiet.
    "cleanup_interval": 1,
    # poll(), not select(): select() fails on a descriptor above 1023, and a daemon with
    # its ZeroMQ and relay connections (LimitNOFILE=65536) can hand the endpoint one;
    # the loop thread would die and /metrics with it.
    "asyncore_use_poll": True,
    # A scrape's request head is a few hundred bytes; waitress buffers a head up to this
    # per connection before answering 431 (its default, 256 KiB, is 64 MiB over 256
    # connections). A client trickling a head is not idle: it keeps its place until then.
    "max_request_header_size": 8192,
    # No endpoint reads a body: any is refused (413) at once, where the default would
    # buffer up to 1 GB a connection in a temporary file before calling the app.
    "max_request_body_size": 1,
    # A client that resets its connection (a scanner, a scrape that timed out) is not
    # the daemon's error: no traceback for it.
    "log_socket_errors": False,
    "ident": None,  # no Server header naming the software
    "clear_untrusted_proxy_headers": True,  # no proxy in front: X-Forwarded-* are dropped
}

# What waitress logs at warning is worth seeing: "Task queue depth is N" (more
# requests at once than threads: something besides Prometheus is asking, or a render is
# slow) and "total open connections reached the connection limit" (a flood). But both
# come once per request or per accepted connection while it lasts: at most one line per
# message every 10 s, the next saying how many were held back.
WAITRESS_LOGGERS = ("waitress", "waitress.queue")


class _ThrottledLines(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.throttle = LogThrottle(interval_s=10.0)

    def filter(self, record: logging.LogRecord) -> bool:
        held = self.throttle.admit((record.name, record.msg))
        if held is None:
            return False
        if held:
            record.msg = f"{record.getMessage()} ({held} more like this since the last such line, not logged)"
            record.args = ()
        record.suppressed = held
        return True


_THROTTLED = _ThrottledLines()


@dataclass(frozen=True)
class Endpoint:
    """A waitress server answering on its own daemon thread."""

    server: BaseWSGIServer
    thread: threading.Thread
    host: str  # as given (the URL's host)

    @property
    def port(self) -> int:
        return int(self.server.effective_port)  # getnameinfo's: a string

    def url(self, path: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        """Close the listening socket and every connection (in the loop thread, which
        then returns), and stop the threads (tests; daemons keep theirs to the end)."""
        self.server.trigger.pull_trigger(lambda: wasyncore.close_all(self.server._map))
        self.thread.join(timeout=10)
        self.server.task_dispatcher.shutdown()


def serve_wsgi(app: Any, host: str, port: int, name: str, **settings: Any) -> Endpoint:
    """Serve a WSGI app on host:port (port 0: any free port) from a daemon thread named
    ``name``, with HTTP_SETTINGS (``settings`` override them: tests)."""
    for logger in WAITRESS_LOGGERS:
        logging.getLogger(logger).addFilter(_THROTTLED)  # once: addFilter skips one it has
    # waitress listens on every address a name resolves to (localhost: 127.0.0.1 and
    # ::1, each with its own free port); the URL names one: the first, as http.server did.
    address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][4][0]
    server = waitress.create_server(app, host=address, port=port, **{**HTTP_SETTINGS, **settings})
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    return Endpoint(server, thread, host)


def serve_metrics(host: str = "127.0.0.1", port: int = 0) -> str:
    """Start the /metrics HTTP endpoint (port 0: any free port); returns its URL."""
    return serve_wsgi(make_wsgi_app(), host, port, "metrics-http").url("/metrics")
