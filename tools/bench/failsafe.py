"""Steps lost to an etcd outage (docs/operations/failsafe.md): a trainer mid-run loses etcd's quorum.

    python -m rlfleet.tools.bench.failsafe --outages 30 90 --json tools/bench/results/failsafe.json

For every outage length: a fresh 3-member etcd, a relay and a sim-backend trainer (real
daemon processes), a feeder that keeps complete groups coming over the reward-host's
ReliableSender; after ``--warmup-s`` two etcd members are killed (quorum lost) for the
outage, then started again, and the run goes on for ``--after-s``. Reported: steps and
groups trained twice (the trainer's own resume lines: ``resumed at version C (the
checkpoint's), S steps (K groups) to re-train`` after the first), resumes, versions in
metrics.jsonl (strictly increasing, the re-trained lines aside?), every (version, term)
weights/latest took (never backwards? how many terms, i.e. trainers, published), and
whether the distinct steps equal the final version (what summary.json reports as steps).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.members import Member
from rlfleet.common.control.records import RelayMaster, WeightsLatest
from rlfleet.common.control.store import StoreUnavailable
from rlfleet.common.wire.arrays import Float32Array, Int32Array
from rlfleet.common.wire.messages import ScoredTrajectory, Trajectory, Turn
from rlfleet.common.wire.reliable import ReliableSender
from rlfleet.tools.run.etcd_local import EtcdCluster

JOB = "failsafe"
REPO = Path(__file__).resolve().parents[2]
SPEC = """\
[job]
name = "{job}"
runs_dir = "{runs}"

[etcd]
lease_ttl_s = 2.0

[model]
path = "{model}"

[task.env]
kind = "arithmetic"

[task]
group_size = 2

[trainer]
batch_size = 4
checkpoint_every = {checkpoint_every}
max_steps = 1000000

[trainer.backend]
kind = "sim"
time_scale = 0.05
fixed_s = 1.0
tokens_per_s = 1000.0
weight_mib = 1

[relay]
chunk_mib = 1
"""
RESUME = re.compile(r"resumed at version (\d+) \(the checkpoint's\), (\d+) steps \((\d+) groups\) to re-train")


def scored(p: int, k: int, reward: float, tokens: tuple[int, ...]) -> ScoredTrajectory:
    turn = Turn(prompt_token_ids=Int32Array([1, 5, 6]), token_ids=Int32Array(list(tokens)),
                logprobs=Float32Array([-1.0] * len(tokens)), weight_version=0, observation="o", action="a")
    traj = Trajectory(trajectory_id=f"p{p}-g{k}", prompt_id=p, group_id=f"p{p}", task="arithmetic",
                      turns=[turn], env_reward=reward)
    return ScoredTrajectory(trajectory=traj, reward=reward)


class Feeder(threading.Thread):
    """Complete groups at ``rate`` groups/s to whatever trajectories address the trainer
    member publishes (a new one after a restart of its worker); unacked ones are resent."""

    def __init__(self, store: EtcdStore, member_key: str, rate: float) -> None:
        super().__init__(daemon=True)
        self.store, self.member_key, self.rate = store, member_key, rate
        self.stop = threading.Event()
        self.sent_groups = 0

    def _address(self) -> str | None:
        try:
            kv = self.store.get(self.member_key)
        except StoreUnavailable:
            return None
        return Member.from_kv(JobKeys(JOB), kv).address("trajectories") if kv else None

    def run(self) -> None:
        sender, addr, p = None, None, 0
        while not self.stop.is_set():
            now = self._address() if sender is None or sender.pending() > 8 else addr
            if now and now != addr:
                if sender is not None:
                    sender.close()
                sender, addr = ReliableSender(now, resend_after_s=0.5), now
                p = max(0, p - 16)  # resend the last few: duplicates are acked and ignored
            if sender is None:
                self.stop.wait(0.2)
                continue
            if sender.pending() <= 8:
                for st in (scored(p, 0, 1.0, (7, 8)), scored(p, 1, 0.0, (9, 10, 2))):
                    sender.send(st.trajectory.trajectory_id, st)
                p += 1
                self.sent_groups = max(self.sent_groups, p)
            sender.poll(0.0)
            self.stop.wait(1.0 / self.rate)
        if sender is not None:
            sender.close()


def watch_latest(store: EtcdStore, key: str, out: list[tuple[int, int]], stop: threading.Event) -> None:
    last = None
    while not stop.wait(0.05):
        try:
            kv = store.get(key)
        except StoreUnavailable:
            continue
        if kv is not None and kv.mod_revision != last:
            last = kv.mod_revision
            r = WeightsLatest.from_kv(kv)
            out.append((r.version, r.term))


def wait_for(what: str, fn: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = fn()
            if value:
                return value
        except StoreUnavailable:
            pass
        time.sleep(0.1)
    raise TimeoutError(what)


def run_once(outage_s: float, warmup_s: float, after_s: float, rate: float, checkpoint_every: int,
             model: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rlfleet-failsafe-"))
    shm = f"/dev/shm/rlfleet-bench-{uuid.uuid4().hex[:8]}"
    cluster = EtcdCluster(3, base_dir=tmp / "etcd").start()
    spec = tmp / "spec.toml"
    spec.write_text(SPEC.format(job=JOB, runs=tmp / "runs", model=model, checkpoint_every=checkpoint_every))
    keys = JobKeys(JOB)
    store = EtcdStore(cluster.endpoints, timeout_s=0.5)
    from rlfleet.common.spec.job import load_spec
    store.put(keys.spec, load_spec(spec).to_dict())
    # The feeder plays the env-hosts too: its prompts are claimed, as the trainer's intake requires.
    store.put(keys.prompts_cursor, {"next": 10**9, "claims": {"feeder": [[0, 10**9]]}})
    procs: list[subprocess.Popen] = []

    def start(role: str, member_id: str) -> None:
        args = ["--spec", str(spec)] if role == "trainer" else ["--host", "host-a"]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "rlfleet.tools.cli", "daemon", role, "--job", JOB,
             "--etcd", cluster.endpoints_arg, "--id", member_id, *args],
            stdout=open(tmp / f"{member_id}.log", "ab"), stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO,
            env={**os.environ, "RLFLEET_RUN_DIR": str(tmp / "run"), "RLFLEET_RELAY_SHM_ROOT": shm}))

    latest: list[tuple[int, int]] = []
    stop = threading.Event()
    feeder = Feeder(store, keys.member("trainer", "trainer-a"), rate)
    try:
        start("relay", "relay-a")
        wait_for("a master relay", lambda: RelayMaster.read(store, keys), 60)
        start("trainer", "trainer-a")
        threading.Thread(target=watch_latest, args=(store, keys.weights_latest, latest, stop),
                         daemon=True).start()
        feeder.start()
        wait_for("the first publication", lambda: latest, 60)
        time.sleep(warmup_s)  # the run before the outage (its length is the bench's input)
        before = _versions(tmp)
        for m in cluster.members[1:]:
            cluster.kill_member(m)
        lost_at = time.monotonic()
        time.sleep(outage_s)  # the outage under test
        for m in cluster.members[1:]:
            cluster.start_member(m, wait=False)
        cluster.wait_healthy()
        back_s = time.monotonic() - lost_at
        time.sleep(after_s)
        feeder.stop.set()
        feeder.join(10)
    finally:
        stop.set()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        store.close()
        cluster.stop()
        shutil.rmtree(shm, ignore_errors=True)
    log = (tmp / "trainer-a.log").read_text()
    resumes = [tuple(map(int, m.groups())) for m in RESUME.finditer(log)]
    versions = _versions(tmp)
    first_made = _versions(tmp, replayed=False)
    lines = len(versions)
    result = {
        "outage_s": outage_s, "quorum_back_after_s": round(back_s, 1),
        "steps_before_outage": len(before), "final_version": versions[-1] if versions else 0,
        "metrics_lines": lines,
        "resumes_from_checkpoint": len(resumes),
        "steps_retrained": sum(s for _, s, _ in resumes[1:]),
        "groups_retrained": sum(k for _, _, k in resumes[1:]),
        "versions_strictly_increasing": all(b > a for a, b in zip(first_made, first_made[1:])),
        "latest_never_backwards": all(b[0] >= a[0] for a, b in zip(latest, latest[1:])),
        "publishing_terms": sorted({t for _, t in latest}),
        "latest_updates": len(latest),
        "failsafe_logged": "failsafe: trainer leadership unconfirmed" in log,
        "confirmed_logged": "continuing from in-memory state" in log,
        "run_dir": str(tmp),
    }
    # summary.json reports the final version as the run's steps; a retrained step has a
    # second line in metrics.jsonl ("replayed"), so the lines are more than the steps.
    result["summary_steps"] = result["final_version"]
    result["distinct_steps"] = len(set(versions))
    result["summary_steps_consistent"] = (result["distinct_steps"] == result["summary_steps"]
                                          == lines - result["steps_retrained"])
    return result


def _versions(tmp: Path, replayed: bool = True) -> list[int]:
    """The step lines' versions (``replayed=False``: without the re-trained steps' lines)."""
    path = tmp / "run" / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [x["version"] for x in lines if "version" in x and (replayed or not x.get("replayed"))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outages", type=float, nargs="+", default=[30.0, 90.0])
    ap.add_argument("--warmup-s", type=float, default=10.0)
    ap.add_argument("--after-s", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=8.0, help="groups fed per second")
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--model", type=Path, default=REPO / "models" / "tiny-qwen2")
    ap.add_argument("--json", type=Path, default=REPO / "tools" / "bench" / "results" / "failsafe.json")
    args = ap.parse_args(argv)
    results = []
    for outage in args.outages:
        r = run_once(outage, args.warmup_s, args.after_s, args.rate, args.checkpoint_every, args.model)
        print(json.dumps(r), flush=True)
        results.append(r)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"runs": results}, indent=1) + "\n")
    print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
