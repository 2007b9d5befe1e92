"""Fillers of docs/results/relay.md: the 16-core tables and the figures derived from relay_h100.json
(first device call and its re-run) and relay_h100_postfix.json (after the TCP send fix)."""

from __future__ import annotations

import math
from typing import Any

from rlfleet.tools.bench.pages import Records, filler, span

FIRST = "relay_h100.json"
POSTFIX = "relay_h100_postfix.json"
MIB = 1 << 20
PS = (1, 2, 4, 8, 16)
RATIO_PS = (8, 16)
# (row label, method, chunk MiB (None: the whole version), summary field, format of T(p)/T(1))
H100_ROWS = (
    ("chain, 4 MiB chunks", "chain", 4, "median_s", ".2f"),
    ("trainer stall", "chain", 4, "trainer_stall_s", ".2f"),
    ("chain, 32 MiB chunks", "chain", 32, "median_s", ".2f"),
    ("trainer stall", "chain", 32, "trainer_stall_s", ".2f"),
    ("store-and-forward, 32 MiB chunks", "store_forward", 32, "median_s", ".1f"),
    ("gloo broadcast", "gloo", None, "median_s", ".1f"),
)


def _key(method: str, size_mib: int, chunk_mib: int | None) -> str:
    return f"{method}/tcp/{size_mib}MiB/chunk{chunk_mib or size_mib}MiB/loopback"


def _config(summary: dict[str, Any], method: str, size_mib: int, chunk_mib: int | None) -> dict[str, Any]:
    return summary["by_config"][_key(method, size_mib, chunk_mib)]


def _excluded_ps(records: list[dict[str, Any]], method: str, size_mib: int, chunk_mib: int | None) -> set[int]:
    chunk = (chunk_mib or size_mib) * MIB
    return {r["p"] for r in records if r.get("excluded") and r["method"] == method
            and r["size_bytes"] == size_mib * MIB and r["chunk_bytes"] == chunk}


def _h100_row(data: dict[str, Any], size_mib: int, row: tuple) -> str:
    label, method, chunk, field, ratio_fmt = row
    values = _config(data["summary"], method, size_mib, chunk)[field]
    starred = _excluded_ps(data["records"], method, size_mib, chunk)
    cells = [f"{values[str(p)]:.2f}{'*' if p in starred else ''}" for p in PS]
    ratios = [format(values[str(p)] / values["1"], ratio_fmt) for p in RATIO_PS]
    return "| " + " | ".join([label, *cells, *ratios]) + " |"


def _h100_table(data: dict[str, Any], size_mib: int, title: str) -> str:
    cpus, net = data["machine"]["cpus"], data["records"][0]["net"]
    head = [f"{title}, {cpus} cores, {net}", *(f"p={p}" for p in PS), *(f"T({p})/T(1)" for p in RATIO_PS)]
    link = _config(data["summary"], "link", size_mib, None)["median_s"]["1"]
    rows = [_h100_row(data, size_mib, row) for row in H100_ROWS]
    link_row = f"| raw link (socket copy, 1 receiver) | {link:.2f} |" + " |" * (len(head) - 2)
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *rows, link_row])


@filler
def relay_h100_table_256mib(record: Records) -> str:
    """Medians, trainer stalls and T(p)/T(1) of every method at 256 MiB on 16 cores."""
    return _h100_table(record(FIRST), 256, "256 MiB")


@filler
def relay_h100_table_1gib(record: Records) -> str:
    """Medians, trainer stalls and T(p)/T(1) of every method at 1 GiB on 16 cores (* = one run kept)."""
    return _h100_table(record(FIRST), 1024, "1 GiB")


def _excluded(record: Records) -> list[dict[str, Any]]:
    return [r for r in record(FIRST)["records"] if r.get("excluded")]


@filler
def relay_excluded_run_s(record: Records) -> str:
    """Seconds the run excluded for a false repair took."""
    return span([r["seconds"] for r in _excluded(record)], ".1f")


def _postfix_p16(record: Records) -> list[dict[str, Any]]:
    return [r for r in record(POSTFIX)["runs"]["1gib"]["records"] if r["p"] == 16]


@filler
def relay_postfix_p16_runs(record: Records) -> str:
    """The 1 GiB p=16 runs after the fix: the slowest (which, by its place in the record) and the others' range."""
    seconds = [r["seconds"] for r in _postfix_p16(record)]
    slowest = max(range(len(seconds)), key=seconds.__getitem__)
    which = "the first" if slowest == 0 else f"run {slowest + 1} of {len(seconds)}"
    others = span(sorted(seconds)[:-1], ".2f")
    return f"took {seconds[slowest]:.2f} s ({which}; the others\ntook {others} s)"


def _p1_median(summary: dict[str, Any], chunk_mib: int) -> float:
    return _config(summary, "chain", 1024, chunk_mib)["median_s"]["1"]


@filler
def relay_rerun_p1_slower_pct(record: Records) -> str:
    """How much slower p=1 (1 GiB chain) was in the re-run than in the first call, over both chunk sizes."""
    data = record(FIRST)
    slower = [_p1_median(data["rerun_summary"], c) / _p1_median(data["summary"], c) - 1 for c in (4, 32)]
    return span([100 * s for s in slower], ".0f")


def _fits(record: Records) -> list[dict[str, Any]]:
    return list(record(FIRST)["summary"]["appendix_c_fit"]["loopback"].values())


@filler
def relay_h100_t_byte_span(record: Records) -> str:
    """Range of the fitted T_byte (s/GB per hop) over the 256 MiB and 1 GiB fits on 16 cores."""
    return span([f["T_byte_s_per_GB"] for f in _fits(record)], ".2f")


@filler
def relay_h100_t_start_span_ms(record: Records) -> str:
    """Range of the fitted T_start (ms per chunk) over the 256 MiB and 1 GiB fits on 16 cores."""
    return span([1000 * f["T_start_s"] for f in _fits(record)], ".1f")


@filler
def relay_h100_repair_ms(record: Records) -> str:
    """Milliseconds from relay-0 seeing the failure to sending to relay-2 again, on 16 cores."""
    return span([1000 * r["repair_s"] for r in record(FIRST)["summary"]["repair"]], ".1f")


def _gloo_first_over_second(records: list[dict[str, Any]]) -> list[float]:
    runs: dict[tuple[int, int], list[float]] = {}
    for r in records:
        if r["method"] == "gloo":
            runs.setdefault((r["size_bytes"], r["p"]), []).append(r["seconds"])
    return [s[0] / s[1] for s in runs.values()]


@filler
def relay_gloo_first_vs_second_span(record: Records) -> str:
    """Range of gloo's first broadcast over its second, over every size and p on 16 cores."""
    return span(_gloo_first_over_second(record(FIRST)["records"]), ".1f")


def _stall_growth_to_p8_pct(record: Records, size_mib: int) -> str:
    stall = _config(record(FIRST)["summary"], "chain", size_mib, 32)["trainer_stall_s"]
    worst = max(stall[str(p)] / stall["1"] for p in PS if p <= 8)
    return f"{math.ceil(100 * (worst - 1))}"


@filler
def relay_stall_flat_256mib_pct(record: Records) -> str:
    """Bound (%) on the growth of the trainer's stall up to p=8, 32 MiB chunks, 256 MiB."""
    return _stall_growth_to_p8_pct(record, 256)


@filler
def relay_stall_flat_1gib_pct(record: Records) -> str:
    """Bound (%) on the growth of the trainer's stall up to p=8, 32 MiB chunks, 1 GiB."""
    return _stall_growth_to_p8_pct(record, 1024)


@filler
def relay_link_over_gloo_span(record: Records) -> str:
    """How many times faster gloo's p=1 broadcast is than our raw socket copy, at 256 MiB and 1 GiB."""
    summary = record(FIRST)["summary"]
    return span([_config(summary, "link", s, None)["median_s"]["1"] / _config(summary, "gloo", s, None)
                  ["median_s"]["1"] for s in (256, 1024)], ".1f")


def _chain_p16(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The chain configs with p=16 and at least 16 chunks per version (fewer is discussed apart on the page)."""
    out = []
    for key, row in summary["by_config"].items():
        method, _, size, chunk, _ = key.split("/")
        if method == "chain" and "16" in row["median_s"] and int(size[:-3]) // int(chunk[5:-3]) >= 16:
            out.append(row)
    return out


def _p16_ratio_span(summary: dict[str, Any], field: str) -> str:
    return span([row[field]["16"] / row[field]["1"] for row in _chain_p16(summary)], ".1f")


@filler
def relay_p16_ratio_span_first_call(record: Records) -> str:
    """Range of the chain's T(16)/T(1) in the first device call (configs with ≥ 16 chunks)."""
    return _p16_ratio_span(record(FIRST)["summary"], "median_s")


@filler
def relay_p16_ratio_span_rerun(record: Records) -> str:
    """Range of the chain's T(16)/T(1) in the re-run device call."""
    return _p16_ratio_span(record(FIRST)["rerun_summary"], "median_s")


@filler
def relay_p16_stall_growth_span(record: Records) -> str:
    """Range of the chain's stall(16)/stall(1) over both device calls (configs with ≥ 16 chunks)."""
    data = record(FIRST)
    rows = _chain_p16(data["summary"]) + _chain_p16(data["rerun_summary"])
    return span([row["trainer_stall_s"]["16"] / row["trainer_stall_s"]["1"] for row in rows], ".1f")
