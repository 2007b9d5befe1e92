"""The soak's command: ``python -m rlfleet.tools.bench.soak`` (the package docstring is its help).

    python -m rlfleet.tools.bench.soak --hours 2 --json runs/bench/soak.json   # a soak, as root
    python -m rlfleet.tools.bench.soak --render   # docs/results/soak.md from the committed records

A soak runs (``runner.Soak``) until its duration or a stop (Ctrl-C, SIGTERM), then its
record and figure are written whatever happened (``record``); the exit is 0 when every
verdict holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import traceback
from pathlib import Path

import rlfleet.tools.bench.soak as package
from rlfleet.tools.bench.soak import REPO
from rlfleet.tools.bench.soak.faults import (
    DISK_FULL_EVERY_MIN,
    DISK_FULL_S,
    ETCD_DOWN_S,
    ETCD_LOSS_EVERY_MIN,
    KILL_EVERY_MIN,
    QUIET_END_S,
)
from rlfleet.tools.bench.soak.page import PAGE, read_records, render
from rlfleet.tools.bench.soak.record import JSON_DEFAULT, build_record, plot
from rlfleet.tools.bench.soak.runner import HOURS, TMPFS_MIB, WINDOW_MIN, Soak
from rlfleet.tools.bench.soak.sampling import SAMPLE_S


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlfleet.tools.bench.soak", description=package.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hours", type=float, default=HOURS)
    ap.add_argument("--kill-every-min", type=float, default=KILL_EVERY_MIN,
                    help="kill -9 of a daemon (<= 0: none)")
    ap.add_argument("--etcd-loss-every-min", type=float, default=ETCD_LOSS_EVERY_MIN)
    ap.add_argument("--etcd-down-s", type=float, default=ETCD_DOWN_S)
    ap.add_argument("--disk-full-every-min", type=float, default=DISK_FULL_EVERY_MIN)
    ap.add_argument("--disk-full-s", type=float, default=DISK_FULL_S)
    ap.add_argument("--quiet-end-s", type=float, default=QUIET_END_S, help="no fault this close to the end "
                    "(at most a tenth of the run)")
    ap.add_argument("--sample-s", type=float, default=SAMPLE_S)
    ap.add_argument("--window-min", type=float, default=WINDOW_MIN,
                    help="drop share window (at most a sixth of the run)")
    ap.add_argument("--tmpfs-mib", type=int, default=TMPFS_MIB, help="the runs' tmpfs")
    ap.add_argument("--seed", type=int, default=0, help="which daemons and etcd members are killed")
    ap.add_argument("--examples", type=Path, default=REPO / "examples")
    ap.add_argument("--work-root", type=Path, default=None, help="where the work dir goes (default: $TMPDIR)")
    ap.add_argument("--json", type=Path, default=JSON_DEFAULT)
    ap.add_argument("--png", type=Path, default=None, help="default: the JSON's path with .png")
    ap.add_argument("--render", action="store_true", help=f"run nothing: write {PAGE.relative_to(REPO)} from the "
                    "committed records (tools/bench/results/soak*.json) and exit")
    args = ap.parse_args(argv)
    if args.render:
        records = read_records()
        PAGE.write_text(render(records))
        print(f"wrote {PAGE} from {len(records)} record(s)")
        return 0
    soak = Soak(args)

    def request_stop(*_: object) -> None:
        soak.stop.set()
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        soak.setup()
        try:
            soak.run()
        except Exception:  # noqa: BLE001 — a bug of the soak's own: the record is still written
            soak.error = traceback.format_exc()
            print(soak.error, file=sys.stderr, flush=True)
    finally:
        soak.teardown()
    record = build_record(soak)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    png = args.png or args.json.with_suffix(".png")
    plot(record, png)
    v = record["verdicts"]
    for name, r in record["jobs"].items():
        print(f"{name}: exit {r['exit']}, accounting ok {r['accounting_ok']}, drop share {r.get('drop_share')}, "
              f"{r.get('restarts_logged')} restarts logged, longest without a step {r.get('longest_no_step_s')} s, "
              f"{r.get('journal_lines_skipped')} journal lines skipped at the accounting")
    print(f"faults: {json.dumps(record['fault_summary'])}")
    print(f"verdicts: {json.dumps(v)}; growth failures: {record['growth'].get('failed')}, "
          f"members not judged: {record['growth'].get('members_not_judged')}")
    print(f"wrote {args.json} and {png}")
    return 0 if v["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
