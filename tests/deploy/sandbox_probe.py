"""Run inside a lab host as the ExecStart of an `rlfleet@` unit (tests/deploy/test_sandbox_unit.py):
a stand-in daemon that serves the sandbox. It loads common/sandbox/parent.py (copied next to
it: the sandbox is standard library only, so the host needs no rlfleet install), tries a
trivial program once and logs the outcome (as user_code's probe_sandbox does), says
READY=1, and then answers on the Unix socket /var/lib/rlfleet/probe-<member>.sock: one
request is Python source, the answer one JSON object of what `Sandbox.run` made of it.

    python3 sandbox_probe.py <job>:<member_id>
"""

from __future__ import annotations

import json
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parent as sb  # noqa: E402 — the copy of common/sandbox/parent.py beside this file

# CPU well below the wall clock, so a loop is cpu_limit even on a loaded machine.
LIMITS = sb.SandboxLimits(wall_s=20.0, cpu_s=1, memory_mib=128, nproc=8, file_mib=1, tmp_mib=1)


def notify(message: str) -> None:
    address = os.environ.get("NOTIFY_SOCKET", "")
    if address:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(message.encode(), "\0" + address[1:] if address.startswith("@") else address)


def answer(box: sb.Sandbox, source: str) -> dict:
    try:
        r = box.run(source)
    except sb.SandboxUnavailable as exc:
        return {"unavailable": str(exc)}
    return {"reason": r.reason, "detail": r.detail, "stdout": r.stdout,
            "left": len(sb.processes_of(r.uid)), "uid": r.uid, "wall_s": r.wall_s}


def main(instance: str) -> int:
    member = instance.partition(":")[2]
    box = sb.Sandbox(LIMITS)
    print(f"sandbox probe {instance}: state in {box.state_dir}; print(1) -> "
          f"{json.dumps(answer(box, 'print(1)'))}", flush=True)
    path = f"/var/lib/rlfleet/probe-{member}.sock"
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    server.settimeout(5.0)  # the watchdog is pinged at least this often
    notify("READY=1")
    while True:
        notify("WATCHDOG=1")
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        with conn:
            conn.settimeout(60.0)
            chunks = []
            while chunk := conn.recv(65536):
                chunks.append(chunk)
            conn.sendall(json.dumps(answer(box, b"".join(chunks).decode())).encode())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
