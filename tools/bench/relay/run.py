"""The command line: the sweep (records written after each run, then the summary), `plot`
and `worker`."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from rlfleet.tools.bench.relay.analysis import _load_records, fit_appendix_c, plot, summarize
from rlfleet.tools.bench.relay.fleet import Netns, _fits, machine_info, run_chain, run_gloo, run_link, run_repair
from rlfleet.tools.bench.relay.worker import MIB, worker_main


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["plot"]:
        pp = argparse.ArgumentParser(prog="relay plot")
        pp.add_argument("records", nargs="+", help="record files written by --json")
        pp.add_argument("--png", required=True)
        pp.add_argument("--title", default="")
        pa = pp.parse_args(argv[1:])
        plot([r for f in pa.records for r in _load_records(f)], pa.png, pa.title)
        return 0
    if argv[:1] == ["worker"]:
        wp = argparse.ArgumentParser()
        for flag in ("--id", "--bind", "--transport", "--store-dir"):
            wp.add_argument(flag, required=True)
        wp.add_argument("--window", type=int, default=4)
        wp.add_argument("--store-and-forward", action="store_true")
        return worker_main(wp.parse_args(argv[1:]))
    ap = argparse.ArgumentParser(description=sys.modules[__package__].__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", default="256,1024")
    ap.add_argument("--relays", default="1,2,4,8")
    ap.add_argument("--chunk-mib", default="32", help="chunk size(s) for the p sweep")
    ap.add_argument("--fit-chunk-mib", default="4,16,64", help="chunk sizes of the p=1 runs the fit uses")
    ap.add_argument("--methods", default="chain,store_forward,gloo,link")
    ap.add_argument("--transports", default="tcp", help="tcp and/or ucx for the chain")
    ap.add_argument("--net", choices=("auto", "loopback", "netns", "both"), default="both")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--no-repair", action="store_true")
    ap.add_argument("--machine", default=None, help="a name for the machine, kept in the summary")
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    a.transports = a.transports.split(",")
    sizes = [int(s) * MIB for s in a.size_mib.split(",")]
    ps = [int(p) for p in a.relays.split(",")]
    chunks = [int(c) * MIB for c in a.chunk_mib.split(",")]
    fit_chunks = [int(c) * MIB for c in a.fit_chunk_mib.split(",")] if a.fit_chunk_mib else []
    methods = a.methods.split(",")
    why_not = Netns.available() if a.net in ("auto", "netns", "both") else "not requested"
    nets = {"loopback": ["loopback"], "netns": ["netns"], "both": ["loopback", "netns"],
            "auto": ["netns"]}[a.net]
    if why_not is not None and "netns" in nets:
        print(f"note: network namespaces unavailable ({why_not}); loopback only", file=sys.stderr)
        nets = ["loopback"]
    summary: dict[str, Any] = {"cpus": os.cpu_count(), "machine": machine_info(a.machine), "nets": nets,
                               "netns_unavailable": why_not, "repair": [], "skipped": []}
    records: list[dict[str, Any]] = []

    def emit(rec: dict[str, Any]) -> None:
        records.append(rec)
        print(json.dumps(rec), flush=True)
        Path(a.json).write_text(json.dumps(records, indent=1))

    for net in list(nets):
        ns = None
        if net == "netns":
            try:
                ns = Netns(max(ps)).up()
            except (subprocess.CalledProcessError, OSError) as e:
                why = getattr(e, "stderr", None) or str(e)
                summary["netns_unavailable"] = f"setup failed: {str(why).strip()}"
                print(f"note: network namespaces could not be set up ({why}); loopback instead", file=sys.stderr)
                nets.remove("netns")
                if "loopback" in nets:
                    continue
                net = "loopback"
                nets.append(net)
        try:
            for size in sizes:
                data = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
                base = {"size_bytes": size, "net": net}
                if "link" in methods:
                    for t in run_link(data, a.reps, a, ns):
                        emit({"method": "link", "transport": "tcp", "p": 1, "chunk_bytes": size, "seconds": t, **base})
                for tr in a.transports:
                    for chunk in chunks:
                        for p in ps:
                            for m in ("chain", "store_forward"):
                                if m in methods and not _fits(m, p, size):
                                    summary["skipped"].append(f"{m} p={p} {size // MIB} MiB {net}: not enough free memory")
                                elif m in methods:
                                    for t, stall in run_chain(p, data, chunk, a.reps, a, ns, m == "store_forward", tr):
                                        emit({"method": m, "transport": tr, "p": p, "chunk_bytes": chunk,
                                              "seconds": t, "stall_s": stall, **base})
                    if "chain" in methods:
                        for chunk in fit_chunks:
                            if chunk not in chunks:
                                for t, stall in run_chain(1, data, chunk, a.reps, a, ns, False, tr):
                                    emit({"method": "chain", "transport": tr, "p": 1, "chunk_bytes": chunk,
                                          "seconds": t, "stall_s": stall, **base})
                if "gloo" in methods:
                    for p in ps:
                        if not _fits("gloo", p, size):
                            summary["skipped"].append(f"gloo p={p} {size // MIB} MiB {net}: not enough free memory")
                            continue
                        for t in run_gloo(p, size, a.reps, a, ns):
                            emit({"method": "gloo", "transport": "tcp", "p": p, "chunk_bytes": size,
                                  "seconds": t, **base})
                if not a.no_repair and size == sizes[0] and max(ps) >= 4:
                    summary["repair"].append({**run_repair(data, 4 * MIB, a, ns), "net": net})
                del data
        finally:
            if ns is not None:
                ns.down()
    summary["by_config"] = summarize(records)
    summary["appendix_c_fit"] = {net: fit_appendix_c([r for r in records if r["net"] == net]) for net in nets}
    Path(a.json).with_suffix(".summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps({k: summary[k] for k in ("repair", "appendix_c_fit")}, indent=1, default=str))
    return 0
