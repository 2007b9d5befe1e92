"""What a benchmark leaves behind: a record that says what made it (``provenance``: the
command, the commit and its uncommitted changes, the machine, the date), written whole
after every run (a cut bench keeps the runs it finished), its plot, and an exit status
that says whether every run was valid."""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PROVENANCE = ("command", "commit", "machine", "date")
# Records committed before they carried all of PROVENANCE (tests/tools/bench/test_output.py
# holds every other record in tools/bench/results to it). A rerun replaces each.
LEGACY_RECORDS = frozenset({
    "agentic_env.json", "agentic_filter.json", "agentic_routing.json", "failsafe.json", "learning_alone.json",
    "learning_filter_queue.json", "learning_hog.json", "learning_loaded_before_entropy.json",
    "learning_three_task_model.json", "learning_tool_use.json", "learning_vllm.json", "losses.json",
    "megatron_h100.json", "megatron_job_h100.json", "node_add.json", "relay_h100.json", "relay_h100_postfix.json",
    "reward.json", "unit_security.json", "unit_security_sandbox.json", "vllm.json"})


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def machine() -> str:
    """Host, cores, architecture, memory and GPUs (if nvidia-smi finds any)."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpus = _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]) if shutil.which("nvidia-smi") else ""
    names = [line.strip() for line in gpus.splitlines() if line.strip()]
    gpu = f", GPU {', '.join(names)}" if names else ""
    return f"{platform.node()} {os.cpu_count()} cores {platform.machine()} {mem / 2**30:.0f} GiB{gpu}"


def provenance(module: str, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """What every record starts with: ``python -m <module> <argv>``, HEAD, the tracked files
    changed in the working tree (the code the runs execute), the machine and the date."""
    args = sys.argv[1:] if argv is None else list(argv)
    changed = _run(["git", "status", "--porcelain", "--untracked-files=no"]).splitlines()
    return {"command": " ".join(["python", "-m", module, *args]), "commit": _run(["git", "rev-parse", "HEAD"]).strip(),
            "uncommitted_changes": [line[3:] for line in changed], "machine": machine(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def median_range(values: Sequence[float]) -> dict[str, float] | None:
    """A setting's figure over its runs, as records keep it (and pages.median_span shows it):
    the median, the range and how many runs; None when no run has the figure."""
    if not values:
        return None
    return {"median": round(statistics.median(values), 4), "min": min(values), "max": max(values), "n": len(values)}


def write_json(path: Path, payload: Any) -> None:
    """``payload`` as indented JSON at ``path``, replaced whole (a temporary file renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


def finish(records: list[dict[str, Any]], json_path: Path, plot_path: Path | None,
           plot: Callable[[list[dict[str, Any]], Path], None]) -> int:
    """Draw the plot when one was asked for, say where the files went; 0 when every run
    is valid, 1 when any is void."""
    if plot_path:
        plot(records, plot_path)
        print(f"wrote {plot_path}")
    print(f"wrote {json_path}")
    return 0 if all(r["valid"] for r in records) else 1
