"""How long `rlfleet switchover` leaves a singleton without a leader, measured.

    python -m rlfleet.tools.bench.switchover --role resource-manager --rounds 10 --ttl 3

Starts a private etcd and two daemons of the role (`rlfleet daemon`, the spec's lease
TTL `--ttl`), then switches leadership back and forth `--rounds` times with the real
command (`--output json`), and reports each round's time to done and time the leader key
was vacant (as the command saw the watch's delete and create events), with min, median
and max. The daemons' cycle is a third of the TTL; the vacancy does not depend on it
(the successor cycles every 20 ms once the leader marked it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlfleet.common.control.cluster import Cluster
from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.members import Leader
from rlfleet.common.spec.job import parse_spec
from rlfleet.tools.run.etcd_local import EtcdCluster

JOB = "switchover-bench"
MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-qwen2"  # any model folder: no trainer runs


def _cli(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlfleet.tools.cli", *args], stdin=subprocess.DEVNULL,
                            start_new_session=True, **kwargs)


def _wait(what: str, fn, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := fn():
            return value
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", default="resource-manager", choices=["resource-manager", "repack-manager"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--ttl", type=float, default=3.0, help="the spec's etcd.lease_ttl_s")
    parser.add_argument("--json", type=Path, help="write the rounds and the summary here too")
    args = parser.parse_args()
    keys = JobKeys(JOB)
    ids = [f"{args.role}-0", f"{args.role}-1"]
    with tempfile.TemporaryDirectory() as tmp, EtcdCluster(1) as etcd:
        endpoints = etcd.endpoints_arg
        store = EtcdStore(etcd.endpoints)
        spec = parse_spec({"job": {"name": JOB, "runs_dir": tmp}, "etcd": {"lease_ttl_s": args.ttl},
                           "model": {"path": str(MODEL)}, "task": {"env": {"kind": "arithmetic"}}})
        store.put(keys.spec, spec.to_dict())
        procs = []
        try:
            for member_id in ids:
                procs.append(_cli("daemon", args.role, "--job", JOB, "--etcd", endpoints, "--id", member_id,
                                  stdout=open(Path(tmp) / f"{member_id}.log", "ab"), stderr=subprocess.STDOUT))
                _wait(f"{member_id} running", lambda: (m := Cluster.read(store, JOB).member(args.role, member_id))
                      and m.state == "running")
            leader = _wait("a leader", lambda: (kv := store.get(keys.leader(args.role))) and Leader.from_kv(keys, kv).id)
            rounds = []
            for _ in range(args.rounds):
                to = ids[1] if leader == ids[0] else ids[0]
                done = subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "switchover", args.role,
                                       "--to", to, "--job", JOB, "--etcd", endpoints, "--output", "json"],
                                      capture_output=True, text=True, timeout=120)
                out = json.loads(done.stdout)
                if done.returncode:
                    raise SystemExit(f"switchover failed (exit {done.returncode}): {out['message']}")
                rounds.append({"from": leader, "to": to, "elapsed_s": out["elapsed_s"], "vacant_s": out["vacant_s"]})
                print(f"{leader} -> {to}: done in {out['elapsed_s']:.3f} s, leader key vacant {out['vacant_s']:.3f} s")
                leader = to
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                proc.wait(30)
            store.close()
    summary = {key: {"min": min(r[key] for r in rounds), "median": statistics.median(r[key] for r in rounds),
                     "max": max(r[key] for r in rounds)} for key in ("elapsed_s", "vacant_s")}
    print(f"{args.role}, lease TTL {args.ttl:g} s, {len(rounds)} switchovers: vacant "
          f"min {summary['vacant_s']['min']:.3f} / median {summary['vacant_s']['median']:.3f} / "
          f"max {summary['vacant_s']['max']:.3f} s; done in median {summary['elapsed_s']['median']:.2f} s")
    if args.json:
        args.json.write_text(json.dumps({"role": args.role, "ttl_s": args.ttl, "rounds": rounds,
                                         "summary": summary, "cpus": os.cpu_count()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
