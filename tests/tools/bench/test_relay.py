"""The relay benchmark's analysis and its fallback when network namespaces cannot be built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet.tools.bench.relay import analysis
from rlfleet.tools.bench.relay.fleet import Netns
from rlfleet.tools.bench.relay.run import main

MIB = 1 << 20
RESULTS = Path(__file__).resolve().parents[3] / "tools" / "bench" / "results" / "relay_h100.json"


def _rec(method, p, seconds, stall=None, chunk=4 * MIB, **extra):
    rec = {"method": method, "transport": "tcp", "p": p, "chunk_bytes": chunk, "seconds": seconds,
           "size_bytes": 64 * MIB, "net": "loopback", **extra}
    if stall is not None:
        rec["stall_s"] = stall
    return rec


def test_excluded_records_stay_out_of_medians_and_fits():
    recs = [_rec("chain", 1, 1.0, 1.0), _rec("chain", 1, 1.2, 1.2), _rec("chain", 16, 2.0, 1.5),
            _rec("chain", 16, 12.0, 1.4, excluded="false repair"),
            _rec("chain", 1, 1.1, 1.1, chunk=32 * MIB)]
    row = analysis.summarize(recs)["chain/tcp/64MiB/chunk4MiB/loopback"]
    assert row["median_s"] == {1: pytest.approx(1.1), 16: 2.0}
    assert row["T(p)/T(1)"][16] == pytest.approx(2.0 / 1.1)
    assert row["trainer_stall_s"][16] == 1.5
    fit = analysis.fit_appendix_c(recs)[str(64 * MIB)]
    assert fit["comparison"]["p=16,chunk_mib=4"]["measured_s"] == 2.0


def test_plot_of_the_recorded_16_core_run(tmp_path):
    data = json.loads(RESULTS.read_text())
    assert data["machine"]["cpus"] == 16 and "nvidia-h100-x1" in data["machine"]["label"]
    assert sum(1 for r in data["records"] if r.get("excluded")) == 1
    png = tmp_path / "relay.png"
    main(["plot", str(RESULTS), "--png", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(Netns.available() is not None, reason="needs root and `ip netns`")
def test_netns_setup_failure_falls_back_to_loopback(tmp_path):
    # An `ip` that cannot make a bridge (as in a kernel without the module): the bench must run on
    # loopback, say why, and leave no namespace behind.
    fake = tmp_path / "bin"
    fake.mkdir()
    real_ip = subprocess.run(["sh", "-c", "command -v ip"], capture_output=True, text=True).stdout.strip()
    (fake / "ip").write_text(f'#!/bin/sh\ncase "$*" in *bridge*) echo "no bridge here" >&2; exit 2;; esac\n'
                             f'exec {real_ip} "$@"\n')
    (fake / "ip").chmod(0o755)
    before = subprocess.run([real_ip, "netns", "list"], capture_output=True, text=True).stdout
    out = tmp_path / "r.json"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    subprocess.run([sys.executable, "-m", "rlfleet.tools.bench.relay", "--size-mib", "1", "--relays", "1",
                    "--methods", "chain", "--chunk-mib", "1", "--fit-chunk-mib", "", "--reps", "1", "--no-repair",
                    "--net", "netns", "--machine", "test", "--json", str(out)], env=env, check=True, timeout=120,
                   capture_output=True)
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert summary["nets"] == ["loopback"]
    assert "no bridge here" in summary["netns_unavailable"]
    assert summary["machine"]["label"] == "test" and summary["machine"]["cpus"] == os.cpu_count()
    assert [r["net"] for r in json.loads(out.read_text())] == ["loopback"]
    assert subprocess.run([real_ip, "netns", "list"], capture_output=True, text=True).stdout == before
