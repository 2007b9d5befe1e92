"""JSON log lines stay whole when the disk fills: real processes appending to one log
file on a real, small tmpfs (root only: skipped otherwise, saying so), and the
LineWriter's cases on pipes and files."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import select
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from rlfleet.common.logs import JsonLineHandler, LineWriter

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs (a real full filesystem) needs root")

# One daemon-like process: JSON logging on stderr, many long records (lengths varied so
# the disk fills in the middle of lines), then its drop counts on stdout; after a line
# on stdin (the test freed room) one more record.
WRITER = textwrap.dedent("""
    import json, logging, sys
    from rlfleet.common.logs import setup_json_logging
    setup_json_logging("info", role="test", id=sys.argv[1])
    log = logging.getLogger("rlfleet.test")
    for i in range(int(sys.argv[2])):
        log.info("record %d %s", i, "x" * (300 + (i * 997) % 4000), extra={"i": i})
    print(json.dumps(logging.getLogger().handlers[0].dropped), flush=True)
    sys.stdin.readline()
    log.info("room came back", extra={"i": -1})
""")


@pytest.fixture
def small_fs(tmp_path):
    root = tmp_path / "fs"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(root)], check=True)
    try:
        yield root
    finally:
        subprocess.run(["umount", str(root)], check=True)


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], deadline - time.monotonic())[0]:
            return proc.stdout.readline()
    raise AssertionError(f"writer {proc.args[-2]} printed nothing in {timeout_s} s (exit code {proc.poll()})")


@needs_root
def test_two_processes_logging_into_a_full_disk_leave_only_whole_json_lines(small_fs):
    ballast = small_fs / "ballast"
    ballast.write_bytes(b"\0" * (64 << 10))  # freed later, so the writers can log again
    log_path = small_fs / "daemon.log"
    # Like the supervisor (daemons/agent/process.py): one file opened "ab", shared by
    # a daemon and its children.
    with open(log_path, "ab") as out:
        procs = [subprocess.Popen([sys.executable, "-c", WRITER, f"w{k}", "3000"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=out, text=True) for k in range(2)]
    try:
        dropped = {f"w{k}": json.loads(read_line(p, 60)) for k, p in enumerate(procs)}
        ballast.unlink()
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
            assert p.wait(30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    data = log_path.read_bytes()
    assert data.endswith(b"\n")
    lines = data.decode().splitlines()
    bad = []
    entries = []
    for n, line in enumerate(lines, 1):
        try:
            entries.append(json.loads(line))
        except ValueError:
            bad.append(f"line {n}: {line[:80]!r}...")
    assert not bad, f"{len(bad)} of {len(lines)} lines are not JSON: " + "; ".join(bad[:5])
    for writer, by_reason in dropped.items():
        assert set(by_reason) == {"no_space"} and by_reason["no_space"] > 0, (writer, by_reason)
        mine = [e for e in entries if e["id"] == writer]
        # Every drop is reported by a later line of the same writer, and "room came
        # back" is written after the last ones.
        reported = sum(e["dropped"] for e in mine if e.get("event") == "log_records_dropped")
        assert reported == by_reason["no_space"], (writer, reported, by_reason)
        assert mine[-1]["msg"] == "room came back"
        written = [e["i"] for e in mine if "i" in e and e["i"] >= 0]
        assert written == sorted(written) and len(written) + reported == 3000


@contextlib.contextmanager
def short_writes(monkeypatch: pytest.MonkeyPatch, n: int) -> Iterator[None]:
    """os.write takes at most n bytes a call: what a full disk (a regular file) or a
    signal (a pipe) does to a write."""
    real_write = os.write
    with monkeypatch.context() as patch:
        patch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:n])))
        yield


def test_a_short_write_to_a_regular_file_is_cut_back_off(tmp_path, monkeypatch):
    path = tmp_path / "log"
    path.write_bytes(b'{"a": 1}\n')
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        writer = LineWriter(fd)
        with short_writes(monkeypatch, 5):
            assert writer.write(b'{"b": 2}\n') == "no_space"
        assert path.read_bytes() == b'{"a": 1}\n'
        assert writer.write(b'{"c": 3}\n') is None
    finally:
        os.close(fd)
    assert path.read_bytes() == b'{"a": 1}\n{"c": 3}\n'


def test_a_short_write_to_a_pipe_is_finished_in_order(monkeypatch):
    r, w = os.pipe()
    try:
        writer = LineWriter(w)
        assert not writer.regular
        with short_writes(monkeypatch, 3):
            assert writer.write(b'{"b": 2}\n') is None
        assert os.read(r, 100) == b'{"b": 2}\n'
    finally:
        os.close(r)
        os.close(w)


def test_the_handler_counts_what_it_drops_and_says_so_in_its_next_line(tmp_path, monkeypatch):
    path = tmp_path / "log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    handler = JsonLineHandler(fd, {"role": "test"})
    log = logging.getLogger("rlfleet.test.handler")
    log.propagate, log.handlers = False, [handler]
    try:
        def full_disk(fd: int, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")
        with monkeypatch.context() as patch:
            patch.setattr(os, "write", full_disk)
            log.warning("lost one")
            log.warning("lost two")
        log.warning("kept", extra={"event": "x"})
    finally:
        log.handlers = []
        os.close(fd)
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert (first["event"], first["dropped"], first["role"]) == ("log_records_dropped", 2, "test")
    assert first["msg"].startswith("2 log records dropped") and "no_space 2" in first["msg"]
    assert (second["msg"], second["event"]) == ("kept", "x")
    assert handler.dropped == {"no_space": 2}
