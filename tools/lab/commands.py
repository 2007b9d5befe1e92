"""Running the lab's commands: checked, with progress lines on the long ones."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


class CommandFailed(RuntimeError):
    pass


def say(msg: str) -> None:
    print(f"[lab] {msg}", flush=True)


def run(cmd: list[str], *, check: bool = True, timeout: float | None = 120, **kw) -> subprocess.CompletedProcess:
    """Run a short command; its output is captured and shown only when it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise CommandFailed(f"{' '.join(cmd)} exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-2000:]}")
    return proc


def run_long(cmd: list[str], label: str, log: Path, *, every_s: float = 15.0, env: dict | None = None) -> float:
    """Run a long command with its output in `log`, printing a progress line every `every_s`
    (elapsed time and the command's last line), so a person or CI sees it is alive.
    Returns the seconds it took; raises CommandFailed with the log's tail when it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    last_print = t0
    last_line = ""
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                stdin=subprocess.DEVNULL, env=env, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if line.strip():
                last_line = line.strip()
            now = time.monotonic()
            if now - last_print >= every_s:
                say(f"{label}: {now - t0:.0f} s, {last_line[:100]}")
                last_print = now
        rc = proc.wait()
    took = time.monotonic() - t0
    if rc != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise CommandFailed(f"{label} failed (exit {rc}) after {took:.0f} s; log {log}:\n{tail}")
    say(f"{label}: done in {took:.0f} s")
    return took


def require_root() -> None:
    import os
    if os.geteuid() != 0:
        sys.exit("the lab needs root (network namespaces, mounts, systemd-nspawn)")
