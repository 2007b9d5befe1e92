"""The chain as an operator sees it: order, master, and where each version is.

Slow facts come from etcd (relay member registrations, `relay/master`,
`relay/chain`, `weights/latest`); live counters (chunks received/forwarded,
bytes/s, per-version progress) are asked from each relay over its chunk port
(a `StatusQuery`), never written to etcd. Used by `rlfleet status` and by
`python -m rlfleet.relay.status --job J --etcd E`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.records import RelayChain, WeightsLatest
from rlfleet.common.control.store import Store
from rlfleet.common.job_secret import job_secret_from_env
from rlfleet.relay.protocol import Status, StatusQuery
from rlfleet.relay.topology import read_chain
from rlfleet.relay.transport import transport_for


def query_relay(address: str, timeout: float = 1.0, secret: bytes | None = None) -> dict[str, Any] | None:
    """A relay's live counters, or None if it does not answer in time (or refuses us: a relay
    with a job secret answers only peers holding it; None: RLFLEET_JOB_SECRET_FILE's)."""
    try:
        conn = transport_for(address, secret if secret is not None else job_secret_from_env()).connect(
            address, timeout=timeout)
    except (ConnectionError, ValueError, RuntimeError):  # AuthError is a ValueError
        return None
    try:
        conn.send(StatusQuery())
        reply = conn.recv(timeout)
        return dict(reply.stats) if isinstance(reply, Status) else None
    except (ConnectionError, TimeoutError, ValueError):
        return None
    finally:
        conn.close()


STUCK_AFTER_S = 30.0  # behind the latest version with nothing new for this long: not in transit


def lagging(relays: list[dict[str, Any]], latest: int, now: float) -> tuple[list[str], list[str]]:
    """(stuck, in transit): running relays whose newest complete version is behind `latest`.

    While a trainer publishes, a healthy relay is always a version or two behind for a
    moment; it is stuck only when its newest version is STUCK_AFTER_S old (`newest_at`,
    which the relay records when its newest version changes; missing = stuck).
    """
    stuck, in_transit = [], []
    for r in relays:
        if r["state"] != "running" or r["newest"] >= latest:
            continue
        at = r.get("newest_at")
        (in_transit if isinstance(at, (int, float)) and now - at < STUCK_AFTER_S else stuck).append(r["id"])
    return stuck, in_transit


def chain_status(store: Store, job: str, live: bool = True) -> dict[str, Any]:
    keys = JobKeys(job)
    chain = read_chain(store, keys)
    written = RelayChain.read(store, keys)
    latest = WeightsLatest.read(store, keys)
    relays, versions = [], {}
    for rid in list(chain.order) + sorted(set(chain.members) - set(chain.order)):
        m = chain.members[rid]
        stats = query_relay(m.address) if live and m.address else None
        row = {"id": rid, "host": m.host, "address": m.address, "state": m.state,
               "master": rid == chain.master, "successor": m.successor,
               "newest": m.newest, "newest_at": m.newest_at,
               "versions": [list(pair) for pair in m.versions], "live": stats}
        relays.append(row)
        for v, lay in m.versions:
            versions.setdefault(f"{v}/tp{lay}", {"complete": [], "partial": {}})["complete"].append(rid)
        for key, (have, total) in ((stats or {}).get("progress") or {}).items():
            entry = versions.setdefault(key, {"complete": [], "partial": {}})
            if have < total and rid not in entry["complete"]:
                entry["partial"][rid] = f"{have}/{total}"
    problems = []
    if chain.order and chain.master is None:
        problems.append("relay: no master elected")
    in_transit: list[str] = []
    problems += [p for p in (written.problem if written else "", latest.problem if latest else "") if p]
    if latest is not None and not latest.problem:
        stuck, in_transit = lagging(relays, latest.version, time.time())
        if stuck:
            problems.append(f"relay: {', '.join(stuck)} not at version {latest.version} "
                            f"and no new version for {STUCK_AFTER_S:.0f}s or more")
    return {"job": job, "master": chain.master, "order": list(chain.order), "in_transit": in_transit,
            "written_chain": written.to_value() if written is not None else None,
            "latest": latest.to_value() if latest is not None else None,
            "layouts": sorted(chain.layouts), "relays": relays,
            "versions": dict(sorted(versions.items(), key=lambda kv: (-int(kv[0].split("/")[0]), kv[0]))),
            "problems": problems}


def _rate(bps: Any) -> str:
    return f"{bps / 1e9:.2f} GB/s" if isinstance(bps, (int, float)) and bps else "—"


def chain_table(status: dict[str, Any]) -> Any:
    from rich.table import Table

    latest = status.get("latest") or {}
    table = Table(title=f"relay chain of {status['job']}: {' -> '.join(status['order']) or '(no relays)'}"
                        f"   latest version {latest.get('version', '—')}")
    for col in ("#", "relay", "host", "role", "successor", "versions held", "chunks in/out", "in", "out", "repair"):
        table.add_column(col)
    for i, r in enumerate(status["relays"]):
        live = r["live"] or {}
        held = ", ".join(f"{v}" + (f"/tp{lay}" if lay != 1 else "") for v, lay in r["versions"]) or "—"
        repair = live.get("last_repair_s")
        table.add_row(str(i), r["id"], r["host"], "master" if r["master"] else "relay", r["successor"] or "—", held,
                      f"{live.get('chunks_received', '?')}/{live.get('chunks_forwarded', '?')}" if live else "no answer",
                      _rate(live.get("receive_bytes_per_s")), _rate(live.get("forward_bytes_per_s")),
                      f"{repair:.3f}s" if isinstance(repair, float) else "—")
    return table


def versions_table(status: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="where each version is")
    for col in ("version", "complete at", "arriving at"):
        table.add_column(col)
    for key, entry in status["versions"].items():
        partial = ", ".join(f"{rid} ({p})" for rid, p in entry["partial"].items()) or "—"
        table.add_row(key, ", ".join(entry["complete"]) or "—", partial)
    return table


def main(argv: list[str] | None = None) -> int:
    from rlfleet.common.control.etcd_store import EtcdStore
    from rlfleet.common.control.store import StoreUnavailable

    ap = argparse.ArgumentParser(description="Show the relay chain of a job.")
    ap.add_argument("--job", required=True)
    ap.add_argument("--etcd", default="127.0.0.1:2379")
    ap.add_argument("--output", choices=("table", "json"), default="table")
    args = ap.parse_args(argv)
    try:
        status = chain_status(EtcdStore(args.etcd), args.job)
    except StoreUnavailable as exc:
        print(f"error: etcd at {args.etcd} is unreachable: {exc}", file=sys.stderr)
        return 3
    if args.output == "json":
        print(json.dumps(status, indent=2, default=str))
    else:
        from rich.console import Console

        console = Console()
        console.print(chain_table(status))
        console.print(versions_table(status))
        if status["in_transit"]:
            console.print(f"in transit: {', '.join(status['in_transit'])} receiving version "
                          f"{(status['latest'] or {}).get('version')}")
        for p in status["problems"]:
            console.print(f"[yellow]problem:[/yellow] {p}")
    return 1 if status["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
