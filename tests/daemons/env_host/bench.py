"""Throughput of the env-host and reward-host data paths on this machine (not a test).

    python -m tests.daemons.env_host.bench [--seconds 10]

env-host: an EnvRunner with real etcd claims, the journal on disk, a fake rollout that
answers instantly (so the number is the env-host's own ceiling) and a fake reward-host.
reward-host: a RewardService with 2 worker processes and a fake trainer.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
from pathlib import Path

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.wire.messages import Trajectory
from rlfleet.common.wire.reliable import ReliableReceiver, ReliableSender
from rlfleet.daemons.env_host.claims import PromptClaimer
from rlfleet.daemons.env_host.manager import EnvManager, ManagerConfig, TurnCodec
from rlfleet.daemons.env_host.routing import Router
from rlfleet.daemons.reward_host.service import RewardService
from rlfleet.daemons.reward_host.workers import RewardPool
from rlfleet.daemons.tasks import get_task
from rlfleet.tools.run.etcd_local import EtcdCluster
from tests.daemons.env_host.fakes import FakeRollout, answer, policy, tokenizer
from tests.daemons.env_host.test_runner import KEYS, FakeRewardHost, Host, solve
from tests.daemons.reward_host.fakes import FakeTrainer, trajectory


def bench_env_host(endpoints: list[str], seconds: float) -> None:
    store = EtcdStore(endpoints)
    rollout = FakeRollout(policy(solve))
    reward_host = FakeRewardHost()
    host = Host(store, rollout, reward_host, Path(tempfile.mkdtemp()) / "bench.jsonl",
                group_size=8, max_concurrent=64)
    time.sleep(1.0)  # warm-up
    n0, t0 = len(reward_host.unique()), time.monotonic()
    time.sleep(seconds)
    n1, t1 = len(reward_host.unique()), time.monotonic()
    host.stop()
    print(f"env-host: {(n1 - n0) / (t1 - t0):.0f} trajectories/s (arithmetic, 1 turn, G=8, "
          f"64 in flight, instant fake rollout in the same process), {host.runner.claimed} prompts claimed "
          f"in {host.claimer.conflicts} lost swaps")
    reward_host.close()
    rollout.close()

    claimer = PromptClaimer(store, KEYS, "bench")
    lat = []
    for _ in range(200):
        s = time.perf_counter()
        claimer.claim(4)
        lat.append(time.perf_counter() - s)
    print(f"claim (one CAS, no contention): median {statistics.median(lat) * 1e3:.2f} ms, "
          f"p99 {sorted(lat)[197] * 1e3:.2f} ms")
    store.close()


def bench_reissue() -> None:
    task = get_task("arithmetic")
    prompt = task.make_prompts("train", 1)[0]
    stuck = threading.Event()

    def hold(srv, req):
        stuck.set()
        srv._die.wait(10)

    delays = []
    for _ in range(5):
        stuck.clear()
        dying, healthy = FakeRollout(hold), FakeRollout(answer(prompt.answer))

        async def run(dying: FakeRollout = dying, healthy: FakeRollout = healthy) -> float:
            router = Router()
            router.update({"dying": dying.address})
            mgr = EnvManager(task=task, prompt=prompt, prompt_id=0, index=0,
                             codec=TurnCodec(tokenizer()), router=router,
                             config=ManagerConfig(turn_timeout_s=30.0))
            job = asyncio.create_task(mgr.run())
            await asyncio.to_thread(stuck.wait, 5)
            router.update({"dying": dying.address, "healthy": healthy.address})
            t = time.perf_counter()
            await asyncio.to_thread(dying.die)
            traj = await job
            assert traj.dropped_reason == "", traj.info
            router.close()
            return time.perf_counter() - t

        delays.append(asyncio.run(run()))
        healthy.close()
    print(f"rollout killed mid-request -> turn re-issued and answered elsewhere: "
          f"median {statistics.median(delays) * 1e3:.1f} ms (turn timeout 30 s)")


def bench_reward_host(n: int) -> None:
    receiver = ReliableReceiver("tcp://127.0.0.1:0", expect=Trajectory)
    pool = RewardPool(2, 10.0)
    svc = RewardService(receiver=receiver, pool=pool, task_name="arithmetic", task_kwargs={})
    trainer = FakeTrainer()
    svc.set_trainer(trainer.address)
    stop = threading.Event()
    thread = threading.Thread(target=svc.run, args=(stop,), daemon=True)
    thread.start()
    while pool.ready < 2:
        time.sleep(0.05)
    prompts = get_task("arithmetic").make_prompts("train", n)
    trajs = [trajectory(p, i, 0, p.answer) for i, p in enumerate(prompts)]
    sender = ReliableSender(receiver.endpoint, max_pending=n + 1)
    t0 = time.monotonic()
    for t in trajs:
        sender.send(t.trajectory_id, t)
    while sender.pending():
        sender.poll(0.05)
    took = time.monotonic() - t0
    print(f"reward-host: {n / took:.0f} trajectories/s scored, forwarded and acked end to end "
          f"(arithmetic, 2 workers)")
    stop.set()
    thread.join(5)
    sender.close()
    trainer.close()
    pool.close()
    receiver.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    with EtcdCluster(1) as etcd:
        bench_env_host(etcd.endpoints, args.seconds)
    bench_reissue()
    bench_reward_host(3000)


if __name__ == "__main__":
    main()
