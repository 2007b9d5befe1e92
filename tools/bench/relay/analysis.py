"""The records read back: medians and T(p)/T(1) per configuration, the Appendix C fit, the plot."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from rlfleet.tools.bench.relay.worker import MIB


def fit_appendix_c(records: list[dict[str, Any]]) -> dict[str, Any]:
    """T_byte and T_start from single-relay chain runs at several chunk sizes (T(1,k) = M T_byte + k T_start)."""
    records = _kept(records)
    out = {}
    for size in sorted({r["size_bytes"] for r in records}):
        pts = [(r["size_bytes"] / r["chunk_bytes"], r["seconds"]) for r in records
               if r["method"] == "chain" and r["p"] == 1 and r["size_bytes"] == size]
        by_k: dict[float, list[float]] = {}
        for k, t in pts:
            by_k.setdefault(k, []).append(t)
        ks = sorted(by_k)
        if len(ks) < 2:
            continue
        ts = [statistics.median(by_k[k]) for k in ks]
        slope, intercept = np.polyfit(ks, ts, 1)
        t_start, t_byte = max(float(slope), 0.0), float(intercept) / size
        pred = {}
        for r in records:
            if r["method"] == "chain" and r["size_bytes"] == size:
                k = -(-size // r["chunk_bytes"])
                pred.setdefault(f"p={r['p']},chunk_mib={r['chunk_bytes'] // MIB}", {
                    "predicted_s": (r["p"] + k - 1) * (size / k * t_byte + t_start), "measured_s": []}
                )["measured_s"].append(r["seconds"])
        for v in pred.values():
            v["measured_s"] = statistics.median(v["measured_s"])
        out[str(size)] = {"T_byte_s_per_GB": t_byte * 1e9, "T_start_s": t_start, "fit_points": len(ks),
                          "comparison": pred}
    return out


def _kept(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # A record marked {"excluded": why} by hand afterwards (a run hit by something other than
    # what is measured, e.g. a false repair) stays in the file but out of medians, fits and plots.
    return [r for r in records if not r.get("excluded")]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    records = _kept(records)
    ratios: dict[str, Any] = {}
    for (m, tr, size, chunk, net) in sorted({(r["method"], r["transport"], r["size_bytes"], r["chunk_bytes"],
                                              r["net"]) for r in records}):
        sel = [r for r in records if (r["method"], r["transport"], r["size_bytes"], r["chunk_bytes"], r["net"])
               == (m, tr, size, chunk, net)]
        med = {p: statistics.median(r["seconds"] for r in sel if r["p"] == p) for p in sorted({r["p"] for r in sel})}
        stall = {p: statistics.median(r["stall_s"] for r in sel if r["p"] == p)
                 for p in med if all("stall_s" in r for r in sel if r["p"] == p)}
        row = {"median_s": med, "T(p)/T(1)": {p: med[p] / med[1] for p in med} if 1 in med else None}
        if stall:
            row["trainer_stall_s"] = stall
        ratios[f"{m}/{tr}/{size // MIB}MiB/chunk{chunk // MIB}MiB/{net}"] = row
    return ratios


def _load_records(path: str) -> list[dict[str, Any]]:
    data = json.loads(Path(path).read_text())
    return data["records"] if isinstance(data, dict) else data


def plot(records: list[dict[str, Any]], png: str, title: str = "") -> None:
    """Seconds vs p per method (left) and the trainer's stall vs p (right), one row per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    records = _kept(records)
    sizes = sorted({r["size_bytes"] for r in records})
    fig, axes = plt.subplots(len(sizes), 2, figsize=(11, 3.6 * len(sizes)), squeeze=False)
    for row, size in zip(axes, sizes):
        sel = [r for r in records if r["size_bytes"] == size]
        ps = sorted({r["p"] for r in sel})
        for key in sorted({(r["method"], r["chunk_bytes"], r["net"]) for r in sel if r["method"] != "link"}):
            m, chunk, net = key
            pts = [r for r in sel if (r["method"], r["chunk_bytes"], r["net"]) == key]
            xs = sorted({r["p"] for r in pts})
            label = f"{m}" + (f", {chunk // MIB} MiB chunks" if m != "gloo" else "") + f" ({net})"
            row[0].plot(xs, [statistics.median(r["seconds"] for r in pts if r["p"] == x) for x in xs],
                        marker="o", label=label)
            if all("stall_s" in r for r in pts) and m == "chain":
                row[1].plot(xs, [statistics.median(r["stall_s"] for r in pts if r["p"] == x) for x in xs],
                            marker="o", label=label)
        for net in sorted({r["net"] for r in sel if r["method"] == "link"}):
            t = statistics.median(r["seconds"] for r in sel if r["method"] == "link" and r["net"] == net)
            for ax in row:
                ax.axhline(t, ls="--", color="grey", lw=1)
            row[0].annotate(f"raw link, 1 receiver ({net})", (ps[0], t), textcoords="offset points",
                            xytext=(2, 3), fontsize=7, color="grey")
        for ax, what in zip(row, ("seconds until the last relay holds it (log)", "trainer stall (s), chain")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ps, [str(p) for p in ps])
            ax.set_xlabel("relays p")
            ax.set_ylabel(what)
            ax.grid(alpha=0.3, which="both")
            ax.set_title(f"{size // MIB} MiB")
        row[0].set_yscale("log")  # store-and-forward grows p-fold: on a log axis "flat" still reads as flat
        for axis in (row[0].yaxis,):
            axis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            axis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        row[1].set_ylim(bottom=0)
        row[0].legend(fontsize=7)
        if row[1].lines:
            row[1].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
