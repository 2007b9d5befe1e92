"""What the control plane asks of etcd during a real run: requests per method.

    python -m rlfleet.tools.bench.etcd_requests examples/arithmetic.toml --json etcd.json

Runs `rlfleet run SPEC --no-view`, finds the private etcd's address in its output,
scrapes that etcd's own Prometheus endpoint (`/metrics`) every two seconds while the
run lasts, and reports, between the first and the last scrape: requests handled per
gRPC method (`grpc_server_handled_total`; for the LeaseKeepAlive and Watch streams the
messages received, `grpc_server_msg_received_total`, since a stream is handled once,
when it ends), raft proposals committed (each a WAL write), the etcd process's CPU,
and the run's `cpu_s` per daemon from its summary.json. Per-step sources are best
compared per 1000 steps, per-second ones (leases, member polls) per second of wall.
"""

from __future__ import annotations

import argparse
import json
import re
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

_METHOD = re.compile(r'grpc_method="([^"]+)"')


def parse_metrics(text: str) -> dict[str, float]:
    """{name: value} of the counters this report uses, per method where they have one."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        base = name.split("{", 1)[0]
        if base in ("grpc_server_handled_total", "grpc_server_msg_received_total"):
            method = _METHOD.search(name)
            if method:
                key = f"{base}:{method.group(1)}"
                out[key] = out.get(key, 0.0) + float(value)  # summed over result codes
        elif base in ("etcd_server_proposals_committed_total", "process_cpu_seconds_total"):
            out[base] = float(value)
    return out


def report(first: dict[str, float], last: dict[str, float], seconds: float) -> dict[str, Any]:
    delta = {k: last[k] - first.get(k, 0.0) for k in last}
    methods: dict[str, float] = {}
    for key, n in delta.items():
        base, _, method = key.partition(":")
        streamed = method in ("LeaseKeepAlive", "Watch")
        if method and base == ("grpc_server_msg_received_total" if streamed else "grpc_server_handled_total"):
            methods[method] = n
    return {"seconds": round(seconds, 1),
            "requests": {m: int(n) for m, n in sorted(methods.items()) if n},
            "requests_per_s": {m: round(n / seconds, 1) for m, n in sorted(methods.items()) if n},
            "raft_proposals": int(delta.get("etcd_server_proposals_committed_total", 0)),
            "etcd_cpu_s": round(delta.get("process_cpu_seconds_total", 0.0), 1)}


def run_scraped(cmd: list[str], on_line: Callable[[str], None] = lambda line: None,
                every_s: float = 2.0) -> tuple[int, list[str], dict[str, Any] | None]:
    """Run an `rlfleet run ...` command, scraping its private etcd's /metrics every
    ``every_s`` while it lasts: (exit code, its output lines, ``report`` between the first
    and the last scrape or None when there were fewer than two)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    endpoint: list[str] = []  # the metrics URL, once the run named its etcd
    tls: list[ssl.SSLContext] = []  # a secure run's etcd: its CA and client certificate
    scrapes: list[tuple[float, dict[str, float]]] = []

    def scrape() -> None:
        while proc.poll() is None:
            if endpoint:
                try:
                    with urllib.request.urlopen(endpoint[0], timeout=2, context=tls[0] if tls else None) as r:
                        scrapes.append((time.monotonic(), parse_metrics(r.read().decode())))
                except OSError:
                    pass  # not up yet, or already stopped
            time.sleep(every_s)

    threading.Thread(target=scrape, daemon=True).start()
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        on_line(line)
        if not endpoint and (m := re.search(r"etcd (\d+\.\d+\.\d+\.\d+:\d+)", line)):
            # A secure run (the default) makes its private etcd's CA and client certificate in
            # its run dir before it names the etcd, and keeps them until it ends
            # (tools/run/credentials.py); an --insecure run has none and serves plain http.
            run_dir = run_dir_of(lines)
            certs = run_dir / "credentials" / "etcd" if run_dir is not None else None
            if certs is not None and (certs / "ca.crt").is_file():
                context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
                context.load_cert_chain(str(certs / "client.crt"), str(certs / "client.key"))
                tls.append(context)
            endpoint.append(f"{'https' if tls else 'http'}://{m.group(1)}/metrics")
    code = proc.wait()
    if len(scrapes) < 2:
        return code, lines, None
    (t0, first), (t1, last) = scrapes[0], scrapes[-1]
    return code, lines, report(first, last, t1 - t0)


def run_dir_of(lines: list[str]) -> Path | None:
    """The run dir `rlfleet run` names on its first line."""
    return next((Path(m.group(1)) for line in lines if (m := re.match(r"run dir: (\S+)", line))), None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--json", type=Path, help="write the report here too")
    args = ap.parse_args(argv)
    code, lines, result = run_scraped([sys.executable, "-m", "rlfleet.tools.cli", "run", args.spec, "--no-view"],
                                      sys.stdout.write)
    if result is None:
        print("etcd_requests: fewer than two scrapes of etcd's /metrics; nothing to report", file=sys.stderr)
        return code or 1
    run_dir = run_dir_of(lines)
    summary = run_dir / "summary.json" if run_dir else None
    if summary is not None and summary.exists():
        s = json.loads(summary.read_text())
        result["cpu_s"], result["trainer_time_s"] = s.get("cpu_s"), s.get("trainer_time_s")
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return code


if __name__ == "__main__":
    sys.exit(main())
