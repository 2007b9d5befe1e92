"""Every daemon's HTTP endpoint (common/metrics.py: waitress) over real sockets.

prometheus_client's start_http_server, which the daemons used before, starts a thread
per connection: 200 idle connections grew a daemon to 202 threads. Served by waitress,
connections take no thread (its loop thread holds them all, two threads answer), an
idle one is closed after channel_timeout, and past connection_limit newcomers wait in
the kernel's backlog until places free up.
"""

from __future__ import annotations

import logging
import os
import resource
import select
import selectors
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from urllib.parse import urlsplit

import pytest
from prometheus_client import make_wsgi_app

from rlfleet.common.metrics import HTTP_SETTINGS, serve_wsgi

CHANNEL_TIMEOUT_S = HTTP_SETTINGS["channel_timeout"]
# An idle connection is closed by the sweep after channel_timeout: sweeps run every
# cleanup_interval, and the loop wakes at least once a second (its poll timeout).
CLOSED_WITHIN_S = CHANNEL_TIMEOUT_S + HTTP_SETTINGS["cleanup_interval"] + 1 + 3  # + 3 s slack

# A daemon's endpoint as the daemon starts it (common/daemon.py), in its own process so
# its thread count is its own.
DAEMON = textwrap.dedent("""
    import sys
    from rlfleet.common.metrics import serve_metrics
    print(serve_metrics("127.0.0.1", 0), flush=True)
    sys.stdin.readline()
""")


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def closed_by_server(sock: socket.socket) -> bool:
    """True when the server closed the connection (EOF or reset), False while it is open."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def wait_closed(socks: list[socket.socket], deadline: float) -> dict[socket.socket, float]:
    """The time.monotonic() at which the server closed each of ``socks``; fails at ``deadline``."""
    closed: dict[socket.socket, float] = {}
    with selectors.DefaultSelector() as sel:
        for s in socks:
            sel.register(s, selectors.EVENT_READ)
        while len(closed) < len(socks):
            left = deadline - time.monotonic()
            assert left > 0, f"{len(socks) - len(closed)} of {len(socks)} idle connections still open"
            for key, _ in sel.select(left):
                if closed_by_server(key.fileobj):
                    closed[key.fileobj] = time.monotonic()
                    sel.unregister(key.fileobj)
    return closed


def request(port: int, raw: bytes) -> bytes:
    """Send ``raw``, return all the server answers before it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(raw)
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except ConnectionResetError:  # closed with bytes of ours unread
            pass
    return answer


@pytest.fixture
def daemon_endpoint():
    proc = subprocess.Popen([sys.executable, "-c", DAEMON], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        if not select.select([proc.stdout], [], [], 60)[0]:
            raise AssertionError(f"the endpoint printed no URL in 60 s (exit code {proc.poll()})")
        yield proc, proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait()


def test_200_idle_connections_start_no_thread_a_scrape_is_answered_while_they_are_held_and_they_are_closed_after_channel_timeout(
        daemon_endpoint):
    proc, url = daemon_endpoint
    host, port = urlsplit(url).hostname, urlsplit(url).port
    urllib.request.urlopen(url, timeout=10).read()  # answered: the endpoint's threads all run
    before = threads_of(proc.pid)
    first_opened = time.monotonic()
    idle = [socket.create_connection((host, port), timeout=10) for _ in range(200)]
    try:
        # 200 are fewer than connection_limit: all are accepted, and in order, so when
        # the scrape is answered all 200 are held.
        assert len(idle) + 3 <= HTTP_SETTINGS["connection_limit"]
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        assert threads_of(proc.pid) <= before, "the endpoint started threads for idle connections"
        assert "python_info" in body
        # Answered while all 200 were still held (none closed yet by channel_timeout).
        assert not any(closed_by_server(s) for s in idle), "idle connections closed before the scrape's answer"

        closed = wait_closed(idle, deadline=time.monotonic() + CLOSED_WITHIN_S)
        first_closed_s = min(closed.values()) - first_opened
        assert first_closed_s >= CHANNEL_TIMEOUT_S - 0.5, f"an idle connection was closed after {first_closed_s:.1f} s"
        assert threads_of(proc.pid) <= before
        assert "python_info" in urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        for s in idle:
            s.close()


@pytest.fixture
def serve():
    """serve_wsgi in this process; every endpoint closed at the end, its threads gone."""
    before = threading.active_count()
    endpoints = []

    def start(host: str = "127.0.0.1", **settings):
        endpoints.append(serve_wsgi(make_wsgi_app(), host, 0, "metrics-http", **settings))
        return endpoints[-1]

    yield start, before
    for endpoint in endpoints:
        endpoint.close()
    assert threading.active_count() == before, "close() left threads behind"


def test_past_connection_limit_a_scrape_waits_until_channel_timeout_closes_idle_connections(serve):
    start, before = serve
    # 8 connections in all: the listening socket, waitress's wake-up pipe and 6 clients.
    endpoint = start(connection_limit=8, channel_timeout=1, cleanup_interval=1)
    assert threading.active_count() == before + 3  # the loop thread and 2 workers
    opened = time.monotonic()
    idle = [socket.create_connection(("127.0.0.1", endpoint.port), timeout=10) for _ in range(10)]
    try:
        # 6 are accepted; 4 and the scrape wait in the backlog until the sweep closes
        # those 6 (idle for channel_timeout), then all fit.
        body = urllib.request.urlopen(endpoint.url("/metrics"), timeout=10).read().decode()
        answered_s = time.monotonic() - opened
        assert "python_info" in body
        assert answered_s >= 1 - 0.5, f"answered after {answered_s:.1f} s: before the sweep could make room"
        assert [closed_by_server(s) for s in idle[:6]] == [True] * 6
        assert threading.active_count() == before + 3
    finally:
        for s in idle:
            s.close()


def test_a_head_too_large_or_a_body_is_refused_and_a_normal_request_answered(serve):
    start, _ = serve
    port = start().port
    big = request(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20000 + b"\r\n\r\n")
    assert big.startswith(b"HTTP/1.0 431 ") or big == b"", big[:100]  # 431, or reset before it was read
    posted = request(port, b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"a" * 100)
    assert posted.startswith(b"HTTP/1.1 413 "), posted[:100]
    ok = request(port, b"GET /metrics HTTP/1.0\r\n\r\n")
    assert ok.startswith(b"HTTP/1.0 200 OK") and b"python_info" in ok
    assert b"\r\nServer:" not in ok.split(b"\r\n\r\n")[0]  # ident=None


def test_ipv6_and_a_name_are_served_on_one_socket_with_the_host_in_the_url(serve):
    start, _ = serve
    named = start("localhost")  # resolves to 127.0.0.1 and maybe ::1: the first only
    assert named.url("/metrics") == f"http://localhost:{named.port}/metrics"
    assert b"python_info" in urllib.request.urlopen(named.url("/metrics"), timeout=10).read()
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    v6 = start("::1")
    assert v6.url("/metrics") == f"http://[::1]:{v6.port}/metrics"
    assert b"python_info" in urllib.request.urlopen(v6.url("/metrics"), timeout=10).read()


def test_waitress_warnings_are_throttled_to_one_per_message_every_10_s(serve, caplog):
    start, _ = serve
    start()  # installs the throttle on waitress's loggers
    message = f"Task queue depth is %d (test {time.monotonic()})"  # a key of its own: no earlier line counts
    with caplog.at_level(logging.WARNING, logger="waitress.queue"):
        for depth in range(1, 6):
            logging.getLogger("waitress.queue").warning(message, depth)
    assert [r.getMessage() for r in caplog.records if r.name == "waitress.queue"] == [message % 1]


def test_the_endpoint_answers_on_descriptors_above_1023(serve):
    """select() fails on them and its ValueError ends waitress's loop thread: poll() is set."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1200:
        pytest.skip("the soft RLIMIT_NOFILE is below 1200 here")
    start, _ = serve
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        endpoint = start()
        assert endpoint.server.socket.fileno() > 1023
        assert b"python_info" in urllib.request.urlopen(endpoint.url("/metrics"), timeout=10).read()
    finally:
        for fd in held:
            os.close(fd)
