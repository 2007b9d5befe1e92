"""`systemd-analyze security` exposure of each unit in systemd/, as JSON.

    python -m rlfleet.tools.bench.unit_security [--json OUT] [--prefix 'nsenter -t PID -a'] [UNIT ...]
    python -m rlfleet.tools.bench.unit_security --sandbox-dropin systemd/rlfleet@.service

Offline (`--offline=true`, systemd >= 250): the unit files are read as files, so
no booted systemd is needed; the figure is the one systemd prints as "Overall
exposure level" (0.0 best, 10.0 worst) with its rating (OK, MEDIUM, EXPOSED,
UNSAFE), plus each check that counted against the unit. With `--prefix` the
command runs through that prefix instead (e.g. inside a lab host, where
`--offline=false` on an installed unit also sees what systemd fills in at run
time; pass the unit names then, e.g. `rlfleet@arith:rollout-0.service`).

Offline, the unit files are analysed under a temporary `--root` (`stand_in_root`):
the units in its etc/systemd/system (systemd analyses a template there as its
instance `@i`), this machine's own system units in its usr/lib/systemd/system
(the targets every service depends on by default), and stand-ins for the commands
the units run, so neither rlfleet nor etcd needs to be installed here.
tests/systemd/test_units.py runs `systemd-analyze verify` under the same root.
`--sandbox-dropin` adds the node agent's sandbox drop-in (50-sandbox.conf,
daemons/agent/sandbox_dropin.py) to each unit there: the exposure of a daemon that
runs untrusted code.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
UNIT_DIR = REPO / "systemd"
SYSTEM_UNITS = Path("/usr/lib/systemd/system")  # this machine's, from Debian's systemd package
OVERALL = re.compile(r"Overall exposure level for (\S+):\s*([0-9.]+)\s+(\w+)")




def commands(unit_file: Path) -> set[str]:
    """The programs a unit runs (ExecStart=, ExecReload=, ...): systemd checks that
    each exists and is executable."""
    found = set()
    for line in unit_file.read_text().splitlines():
        key, _, value = line.partition("=")
        if key.startswith("Exec") and value.strip():
            found.add(value.split()[0].lstrip("-@:+!"))
    return found


def stand_in_root(root: Path, unit_files: list[Path], dropins: dict[str, str] | None = None) -> list[Path]:
    """A file-system root for systemd-analyze: the units in etc/systemd/system, the
    system's units (sysinit.target, network-online.target, ...) and an executable
    stand-in for every command they run; returns the units' paths in it."""
    for exe in set().union(*map(commands, unit_files)):
        path = root / exe.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\nexit 0\n")
        path.chmod(0o755)
    if not (root / "usr/lib/systemd/system").exists():
        shutil.copytree(SYSTEM_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    unit_dir = root / "etc/systemd/system"
    unit_dir.mkdir(parents=True, exist_ok=True)
    placed = []
    for f in unit_files:
        placed.append(unit_dir / f.name)
        placed[-1].write_text(f.read_text())
        for name, text in (dropins or {}).items():
            (unit_dir / f"{f.name}.d").mkdir(exist_ok=True)
            (unit_dir / f"{f.name}.d" / name).write_text(text)
    return placed


def analyse(unit: str, prefix: list[str], root: Path | None) -> dict[str, Any]:
    """The exposure of one unit: a file under `root` (offline), else a loaded unit."""
    base = [*prefix, "systemd-analyze", "security", "--no-pager"]
    base += [f"--root={root}", "--offline=true"] if root else []
    text = subprocess.run([*base, unit], capture_output=True, text=True, timeout=120)
    match = OVERALL.search(text.stdout + text.stderr)
    if match is None:
        raise RuntimeError(f"systemd-analyze security {unit}: no overall exposure in its output "
                           f"(exit {text.returncode}): {(text.stderr or text.stdout).strip()[-500:]}")
    checks = subprocess.run([*base, "--json=short", unit], capture_output=True, text=True, timeout=120)
    counted = [c for c in json.loads(checks.stdout or "[]") if c.get("exposure")]
    return {
        "unit": unit,
        "exposure": float(match.group(2)),
        "rating": match.group(3),
        "counted": [{"name": c.get("name"), "exposure": c.get("exposure"), "description": c.get("description")}
                    for c in sorted(counted, key=lambda c: -float(c["exposure"]))],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("units", nargs="*", help="unit names (with --prefix) or files (default: systemd/*.service)")
    parser.add_argument("--prefix", default="", help="run systemd-analyze through this command, on loaded units")
    parser.add_argument("--json", dest="out", type=Path, default=None, help="also write the results here")
    parser.add_argument("--sandbox-dropin", action="store_true",
                        help="offline: with the agent's sandbox drop-in (50-sandbox.conf) on each unit")
    args = parser.parse_args(argv)
    prefix = shlex.split(args.prefix)
    if not prefix and shutil.which("systemd-analyze") is None:
        print("systemd-analyze is not installed (Debian: apt-get install systemd)", file=sys.stderr)
        return 1
    results = []
    if prefix:
        results = [analyse(unit, prefix, None) for unit in args.units]
    else:
        files = [Path(u) for u in args.units] or sorted(UNIT_DIR.glob("*.service"))
        dropins = {}
        if args.sandbox_dropin:
            from rlfleet.daemons.agent.sandbox_dropin import DROPIN_NAME, DROPIN_TEXT
            dropins = {DROPIN_NAME: DROPIN_TEXT}
        with tempfile.TemporaryDirectory() as tmp:
            for f, placed in zip(files, stand_in_root(Path(tmp), files, dropins)):
                results.append({**analyse(str(placed), [], Path(tmp)), "file": f.name})
    for r in results:
        print(f"{r.get('file', r['unit']):28} {r['exposure']:4.1f} {r['rating']}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
