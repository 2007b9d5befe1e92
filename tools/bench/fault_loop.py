"""Run fault tests many times in a row, optionally with one core hogged, and count passes.

A fault test that passes 19 times in 20 hides a defect; this is how the project finds
them. Each run is its own pytest process (a fresh interpreter, no state carried over),
and nothing is retried.

    python -m rlfleet.tools.bench.fault_loop --runs 20 --hog --out runs/bench/fault_loop \\
        tests/e2e/test_kill_each_role.py tests/relay/test_faults.py ...

Writes DIR/fault_loop.json ({test: {runs, passed, failed, seconds, failures: [tail of output]}})
and prints one line per test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rlfleet.tools.bench.learning import cpu_hog


def run_once(test: str, timeout_s: float, basetemp: Path) -> tuple[bool, float, str]:
    """One pytest process; its temporary files (run dirs, daemon logs) stay in ``basetemp``
    when it fails, as the evidence, and are removed when it passes."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
           f"--basetemp={basetemp}", test]
    basetemp.parent.mkdir(parents=True, exist_ok=True)  # pytest makes basetemp itself, not its parents
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        ok, out = proc.returncode == 0, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        ok, out = False, f"timed out after {timeout_s:.0f} s\n{exc.stdout or ''}"
    if ok:
        shutil.rmtree(basetemp, ignore_errors=True)
    return ok, time.monotonic() - started, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tests", nargs="+", help="pytest node ids or files")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--hog", action="store_true", help="keep one core busy with a spinning process")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per pytest run")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/fault_loop"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    with cpu_hog(args.hog):
        for test in args.tests:
            r = results[test] = {"runs": 0, "passed": 0, "failed": 0, "seconds": [], "failures": []}
            for i in range(args.runs):
                basetemp = args.out / "tmp" / f"{test.replace('/', '_').replace(':', '_')}-{i}"
                ok, seconds, out = run_once(test, args.timeout_s, basetemp)
                r["runs"] += 1
                r["passed" if ok else "failed"] += 1
                r["seconds"].append(round(seconds, 1))
                if not ok:
                    # The first assertion lines: a `finally` that fails too would hide them in a tail.
                    errors = [line for line in out.splitlines() if line.startswith("E ")][:40]
                    r["failures"].append({"run": i, "errors": errors, "tail": out[-3000:],
                                          "evidence": str(basetemp)})
                print(f"  {test} run {i + 1}/{args.runs}: {'pass' if ok else 'FAIL'} in {seconds:.0f} s "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
                (args.out / "fault_loop.json").write_text(json.dumps(
                    {"hog": args.hog, "runs_each": args.runs, "results": results}, indent=2))
            print(f"{test}: {r['passed']}/{r['runs']} passed, {max(r['seconds']):.0f} s slowest", flush=True)
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
