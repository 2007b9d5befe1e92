"""Agentic scheduling on the simulated fleet: each technique beside its baseline, in the
same daemons, one run after the other (ROLL Flash §5, RollArt §5-§7).

    python -m rlfleet.tools.bench.agentic --json runs/bench/agentic.json --plot-dir docs/img \\
        [--benches env_async,redundant,replication,queue_filter,affinity] [--quick]

Each bench lives in its own module (``tools/bench/agentic_<name>.py``) with

    measure(bench: str, workdir: Path, quick: bool) -> list[dict]  # one record per setting
    plot(bench: str, records: list[dict], path: Path) -> None      # its figure

(one module may serve two benches: ``bench`` says which is asked for),

and every record has at least ``bench``, ``setting`` (a dict, e.g. ``{"mu": 10, "sigma":
10}``), ``baseline`` and ``variant`` (the two figures, in the unit the paper uses, named
in ``unit``), ``speedup`` (variant over baseline, > 1 is better whatever the unit) and
``valid`` (the simulated fleet kept up with its timing model; ``invalid_because`` says
why not). The records of all benches are written to ``--json`` as one list.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

BENCHES = {  # bench name -> module
    "env_async": "rlfleet.tools.bench.agentic_env",
    "redundant": "rlfleet.tools.bench.agentic_env",
    "replication": "rlfleet.tools.bench.agentic_routing",
    "queue_filter": "rlfleet.tools.bench.agentic_filter",
    "affinity": "rlfleet.tools.bench.agentic_routing",
}
REQUIRED = ("bench", "setting", "baseline", "variant", "speedup", "valid")


def check_record(record: dict[str, Any]) -> None:
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        raise ValueError(f"bench record {record!r:.200} lacks {missing}")
    if record["bench"] not in BENCHES:
        raise ValueError(f"bench record names an unknown bench {record['bench']!r}")


def table(records: list[dict[str, Any]]) -> str:
    rows = [("bench", "setting", "baseline", "variant", "unit", "speedup", "valid")]
    for r in records:
        setting = ", ".join(f"{k}={v}" for k, v in r["setting"].items())
        rows.append((r["bench"], setting, f"{r['baseline']:.3g}", f"{r['variant']:.3g}", r.get("unit", ""),
                     f"{r['speedup']:.2f}x", "yes" if r["valid"] else f"NO ({r.get('invalid_because', '')})"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--benches", default=",".join(BENCHES), help="comma-separated, of: " + ", ".join(BENCHES))
    ap.add_argument("--json", type=Path, required=True, help="where to write the records")
    ap.add_argument("--plot-dir", type=Path, help="where to write agentic_<bench>.png")
    ap.add_argument("--workdir", type=Path, default=Path("runs/bench/agentic"), help="run folders")
    ap.add_argument("--quick", action="store_true", help="fewer settings and shorter runs (a smoke test)")
    args = ap.parse_args(argv)
    names = [b for b in args.benches.split(",") if b]
    unknown = [b for b in names if b not in BENCHES]
    if unknown:
        ap.error(f"--benches: unknown {unknown} (known: {', '.join(BENCHES)})")
    records: list[dict[str, Any]] = []
    for name in names:
        module = importlib.import_module(BENCHES[name])
        print(f"== {name}", flush=True)
        got = module.measure(name, args.workdir / name, args.quick)
        for r in got:
            check_record(r)
        records += got
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=1) + "\n")  # after each bench: a cut run keeps its part
        if args.plot_dir is not None:
            args.plot_dir.mkdir(parents=True, exist_ok=True)
            module.plot(name, got, args.plot_dir / f"agentic_{name}.png")
        print(table(got), flush=True)
    print("\n" + table(records))
    return 0 if records and all(r["valid"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
