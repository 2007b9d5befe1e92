"""common/sd_notify.py against real unix datagram sockets (a path and an abstract name)."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from rlfleet.common.sd_notify import MAX_STATUS_CHARS, Notifier

from .notify_listener import NotifyListener


@pytest.fixture(params=["path", "abstract"])
def listener(request, tmp_path):
    address = str(tmp_path / "notify") if request.param == "path" else f"@rlfleet-test-{uuid.uuid4().hex}"
    listener = NotifyListener(address)
    yield listener
    listener.close()


def test_each_message_is_one_datagram_of_key_value_lines(listener):
    n = Notifier(listener.address)
    assert n.enabled
    assert n.ready("registered as relay/relay-0")
    assert n.watchdog()
    assert n.watchdog("a new sentence")
    assert n.stopping("draining relay/relay-0")
    got = [m.fields for m in listener.read(0)]
    assert got == [{"READY": "1", "STATUS": "registered as relay/relay-0"},
                   {"WATCHDOG": "1"},
                   {"WATCHDOG": "1", "STATUS": "a new sentence"},
                   {"STOPPING": "1", "STATUS": "draining relay/relay-0"}]


def test_reloading_carries_the_monotonic_clock(listener):
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    Notifier(listener.address).reloading()
    (m,) = listener.read(0)
    assert m["RELOADING"] == "1"
    assert before <= int(m["MONOTONIC_USEC"]) <= time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def test_a_status_is_one_line_and_fits_in_a_datagram(listener):
    Notifier(listener.address).status("first line\nsecond line\t" + "x" * 5000)
    (m,) = listener.read(0)
    assert set(m.fields) == {"STATUS"}
    assert m["STATUS"].startswith("first line second line xxx")
    assert len(m["STATUS"]) == MAX_STATUS_CHARS and m["STATUS"].endswith("…")
    assert len(("STATUS=" + m["STATUS"]).encode()) < 4096  # systemd's buffer: PIPE_BUF


def test_from_env_takes_the_variables_out_of_the_environment(listener):
    env = {"NOTIFY_SOCKET": listener.address, "WATCHDOG_USEC": "2500000", "WATCHDOG_PID": str(os.getpid()),
           "OTHER": "kept"}
    n = Notifier.from_env(env)
    assert (n.address, n.watchdog_s) == (listener.address, 2.5)
    assert env == {"OTHER": "kept"}  # a daemon's subprocesses must not notify for it
    n.watchdog()
    assert [m.fields for m in listener.read(0)] == [{"WATCHDOG": "1"}]


def test_a_watchdog_meant_for_another_pid_is_not_ours(listener):
    n = Notifier.from_env({"NOTIFY_SOCKET": listener.address, "WATCHDOG_USEC": "2500000",
                           "WATCHDOG_PID": str(os.getpid() + 1)})
    assert n.enabled and n.watchdog_s is None


@pytest.mark.parametrize("usec", ["0", "soon", ""])
def test_no_usable_watchdog_interval_means_no_watchdog(usec):
    assert Notifier.from_env({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": usec}).watchdog_s is None


def test_without_notify_socket_every_call_is_a_no_op():
    n = Notifier.from_env({})
    assert not n.enabled and n.watchdog_s is None
    assert not n.ready("x") and not n.watchdog() and not n.reloading() and not n.stopping()


def test_a_missing_socket_is_reported_not_raised(tmp_path, caplog):
    n = Notifier(str(tmp_path / "gone"))
    assert not n.ready()
    assert not n.watchdog()
    warnings = [r for r in caplog.records if "cannot notify systemd" in r.getMessage()]
    assert len(warnings) == 1  # said once, not every cycle


def test_a_full_queue_drops_instead_of_blocking(tmp_path):
    """systemd busy: its socket queues only net.unix.max_dgram_qlen datagrams. A daemon's
    loop must not hang on it: once the queue is full, notify says False at once."""
    listener = NotifyListener(str(tmp_path / "notify"))  # never read until the end
    try:
        n = Notifier(listener.address)
        # A blocking send would hang here (the test's timeout fails it); False says "dropped".
        results = [n.watchdog() for _ in range(10_000)]
        assert results[0] and not results[-1]
        queued = len(listener.read(0))
        assert queued == results.index(False) and all(not r for r in results[queued:])
        assert n.watchdog()  # room again: sending works again
    finally:
        listener.close()
