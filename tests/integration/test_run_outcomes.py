"""How `rlfleet run` ends, with real processes: each outcome's exit code
(tools/exit_codes.py) and its one-line reason, the view it chooses (plain lines
into a pipe, the live table in a pseudo-terminal), and its run directories.

A crash loop is made with the daemon entry point's test failpoint
(RLFLEET_DAEMON_FAILPOINT=exit_at_start:<role>), not with a broken spec.
"""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlfleet.common.failpoints import DAEMON as DAEMON_FAILPOINT_ENV
from rlfleet.tools.exit_codes import Exit

from .helpers import TINY_MODEL, small_job, write_spec

needs_model = pytest.mark.skipif(not (TINY_MODEL / "tokenizer.json").exists(), reason="models/tiny-qwen2 not built")

# A job that finishes in a few steps: small batches, short answers, an evaluation at
# step 0 and every 2 steps (so the plain lines show evaluations).
SHORT_JOB = small_job(eval_every_steps=2, max_steps=6)


def run_cli(args: list[str], *, env: dict[str, str] | None = None, timeout_s: float = 240) -> subprocess.CompletedProcess:
    """`rlfleet run ...` with stdout and stderr as pipes (not a terminal)."""
    return subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "run", *args], capture_output=True,
                          text=True, timeout=timeout_s, env={**os.environ, **(env or {})})


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_unreachable_etcd_is_one_line_and_exit_3(tmp_path):
    spec = write_spec(tmp_path, job="noetcd")
    proc = run_cli([str(spec), "--etcd", "127.0.0.1:1"], timeout_s=60)
    assert proc.returncode == Exit.ETCD_UNREACHABLE, proc.stdout + proc.stderr
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "etcd at 127.0.0.1:1 is unreachable" in lines[0], lines
    assert not (tmp_path / "runs").exists()  # nothing left behind for a run that never started


@needs_model
def test_a_crash_looping_daemon_ends_the_run_with_exit_5(tmp_path, etcd):
    spec = write_spec(tmp_path, job="crashloop")
    proc = run_cli([str(spec), "--etcd", etcd.endpoints_arg, "--give-up-after", "3/60"],
                   env={DAEMON_FAILPOINT_ENV: "exit_at_start:repack-manager"})
    assert proc.returncode == Exit.DAEMON_GAVE_UP, proc.stdout[-3000:] + proc.stderr[-2000:]
    reason = last_line(proc.stderr)
    assert re.fullmatch(r"rlfleet run: gave up: repack-manager-0 died 3 times in \d+ s \(last: exit code 1\); "
                        r"see .*/logs/repack-manager-0\.log \(exit 5, daemon gave up\)", reason), reason
    # The end summary still comes, and says who restarted.
    assert "== crashloop: daemon gave up (exit 5) ==" in proc.stdout
    assert re.search(r"restarts +repack-manager-0 [23]\b", proc.stdout), proc.stdout[-2000:]


@needs_model
def test_a_job_that_trains_nothing_ends_with_exit_6(tmp_path, etcd):
    # No env-host ever runs (it dies at start, and the supervisor never gives up on it):
    # no trajectory, no training step.
    spec = write_spec(tmp_path, job="idle")
    proc = run_cli([str(spec), "--etcd", etcd.endpoints_arg, "--give-up-after", "0/60", "--max-idle-s", "6"],
                   env={DAEMON_FAILPOINT_ENV: "exit_at_start:env-host"})
    assert proc.returncode == Exit.NO_PROGRESS, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert re.fullmatch(r"rlfleet run: no training step for 6 s \(since the start; --max-idle-s\); see .*/logs "
                        r"\(exit 6, no progress\)", last_line(proc.stderr)), proc.stderr
    assert "steps             none of" in proc.stdout  # the summary says nothing was trained


@needs_model
def test_two_runs_in_the_same_second_get_their_own_run_dirs(tmp_path):
    spec = write_spec(tmp_path, job="twins")
    base = tmp_path / "runs" / "twins"
    base.mkdir(parents=True)
    # Whatever second the two runs start in, its plain name is taken: both must
    # collide and take a suffix (before, the second one crashed in the first's etcd dir).
    now = time.time()
    for dt in range(-2, 120):
        (base / time.strftime("%Y%m%d-%H%M%S", time.localtime(now + dt))).mkdir(exist_ok=True)
    procs = [subprocess.Popen([sys.executable, "-m", "rlfleet.tools.cli", "run", str(spec), "--duration", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    run_dirs = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == Exit.STOPPED, out[-2000:] + err[-2000:]
        assert "stopped: --duration 1 s ran out before the trainer finished" in last_line(err)
        first = out.splitlines()[0]
        assert first.startswith("run dir: "), out
        run_dirs.append(Path(first.removeprefix("run dir: ")))
    assert run_dirs[0] != run_dirs[1]
    for d in run_dirs:
        assert re.fullmatch(r"\d{8}-\d{6}-\d+", d.name) and (d / "logs").is_dir() and (d / "etcd").is_dir()


@needs_model
def test_a_clean_finish_into_a_pipe_prints_plain_lines_a_summary_and_exits_0(tmp_path, etcd):
    spec = write_spec(tmp_path, job="clean", extra=SHORT_JOB)
    proc = run_cli([str(spec), "--etcd", etcd.endpoints_arg])  # no --no-view: a pipe is enough
    out = proc.stdout
    assert proc.returncode == Exit.OK, out[-3000:] + proc.stderr[-2000:]
    lines = out.splitlines()
    assert lines[0].startswith("run dir: ")
    stamp = r"\d\d:\d\d:\d\d "
    assert any(re.fullmatch(stamp + r"job clean: 8 daemons \(7 roles\), etcd .*", line) for line in lines), out
    assert any(re.fullmatch(stamp + r"evaluation at step 0: held-out success [01]\.\d{3} .*", line)
               for line in lines), out
    assert any(re.fullmatch(stamp + r"trainer finished 6 steps", line) for line in lines), out
    assert "\x1b[" not in out  # no terminal control sequences in a pipe
    # The end summary reads as success: no "none live", no "not registered".
    summary = out[out.index("== clean: finished =="):]
    assert "not registered" not in summary and "none live" not in summary
    assert re.search(r"steps +6 of 6 in", summary)
    assert re.search(r"held-out success +[01]\.\d{3} → [01]\.\d{3} \(best", summary)
    assert re.search(r"accounting +ok: \d+ prompts claimed", summary)
    assert "learning_vs_step.png" in summary
    assert re.fullmatch(r"rlfleet run: finished 6 steps; accounting ok; results in .* \(exit 0, ok\)",
                        last_line(out)), last_line(out)


@needs_model
def test_in_a_terminal_the_live_view_draws_the_table(tmp_path, etcd):
    spec = write_spec(tmp_path, job="tty", extra=SHORT_JOB)
    controller, terminal = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "rlfleet.tools.cli", "run", str(spec), "--etcd", etcd.endpoints_arg],
                            stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal,
                            env={**os.environ, "COLUMNS": "200", "LINES": "60", "TERM": "xterm"})
    os.close(terminal)
    chunks = []
    try:
        while True:
            try:
                data = os.read(controller, 65536)
            except OSError:  # EIO: the child closed its side
                break
            if not data:
                break
            chunks.append(data)
        code = proc.wait(timeout=240)
    finally:
        os.close(controller)
        if proc.poll() is None:
            proc.kill()
    out = b"".join(chunks).decode(errors="replace")
    assert code == Exit.OK, out[-3000:]
    assert "addresses" in out and "restarts" in out and "nodes" in out  # the live table's columns
    assert "\x1b[" in out  # drawn with cursor control
    # No plain progress line: in a terminal progress is the table's first line.
    assert not re.search(r"\d\d:\d\d:\d\d step \d+/6 ", out)
    assert "== tty: finished ==" in out
