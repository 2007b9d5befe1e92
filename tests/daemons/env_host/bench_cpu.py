"""CPU-seconds the env-host spends per trajectory (not a test).

    python -m tests.daemons.env_host.bench_cpu [--n 4000] [--profile out.prof]

The env-host's data path as in bench.py (EnvRunner, journal on disk, real etcd claims,
OutboxThread), but the fake rollout and the fake reward-host run in a child process, so
this process's CPU time is the env-host's own. Reports CPU per trajectory (user+system,
all threads) and the split by thread.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def serve_peers(rate: float) -> None:
    """Child process: a fake rollout and a fake reward-host until stdin closes. With a
    rate, the rollout answers every 10 ms a batch of at most rate/100 requests (as a
    real engine finishes a batch of short completions together)."""
    from rlfleet.common.wire.messages import GenerateRequest
    from rlfleet.common.wire.sockets import RequestServer
    from tests.daemons.env_host.fakes import FakeRollout, policy
    from tests.daemons.env_host.test_runner import FakeRewardHost, solve

    answer = policy(solve)
    reward_host = FakeRewardHost()
    if not rate:
        rollout = FakeRollout(answer)
        address, close = rollout.address, rollout.close
    else:
        server = RequestServer("tcp://127.0.0.1:0", name="paced-rollout")
        address, halt = server.endpoint, threading.Event()

        def serve() -> None:
            held: list = []
            per_tick, tick = max(1, round(rate / 100)), time.monotonic()
            while not halt.is_set():
                while (got := server.recv(max(0.0, tick - time.monotonic()))) is not None:
                    held.append(got)
                for ident, rid, req in held[:per_tick]:
                    if isinstance(req, GenerateRequest):
                        server.reply(ident, rid, answer(None, req))  # type: ignore[arg-type]
                del held[:per_tick]
                tick = max(tick + 0.01, time.monotonic())
            server.close()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()

        def close() -> None:
            halt.set()
            thread.join(5)
    print(json.dumps({"rollout": address, "reward_host": reward_host.receiver.endpoint}), flush=True)
    sys.stdin.read()
    reward_host.close()
    close()


class _Peers:
    """The peer addresses of a Host built without in-process fakes."""

    def __init__(self, addresses: dict[str, str]) -> None:
        self.address = addresses["rollout"]
        self.receiver = type("R", (), {"endpoint": addresses["reward_host"]})()


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def thread_cpu() -> dict[str, float]:
    """CPU seconds by thread name (Linux /proc; threads not started by Python are '?')."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(tid), "?")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _gc_timer() -> dict[str, float]:
    """Thread CPU time spent in the cyclic garbage collector from now on."""
    import gc

    out = {"s": 0.0, "n": 0, "gen2": 0, "t": 0.0}

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            out["t"] = time.thread_time()
        else:
            out["s"] += time.thread_time() - out["t"]
            out["n"] += 1
            out["gen2"] += info["generation"] == 2
    gc.callbacks.append(callback)
    return out


def wait(cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark stalled")
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4000, help="trajectories measured (after 500 warm-up)")
    parser.add_argument("--max-concurrent", type=int, default=64)
    parser.add_argument("--profile", help="write a cProfile of the measured part (env loop thread only)")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="rollout answers at most this many per second, in 10 ms batches (0: at once)")
    parser.add_argument("--no-freeze", action="store_true", help="skip gc.freeze() (EnvHost does it)")
    parser.add_argument("--serve-peers", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_peers:
        serve_peers(args.rate)
        return

    from rlfleet.common.control.etcd_store import EtcdStore
    from rlfleet.tools.run.etcd_local import EtcdCluster
    from tests.daemons.env_host.test_runner import Host

    child = subprocess.Popen([sys.executable, "-m", "tests.daemons.env_host.bench_cpu", "--serve-peers",
                              "--rate", str(args.rate)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        peers = _Peers(json.loads(child.stdout.readline()))
        with EtcdCluster(1) as etcd:
            store = EtcdStore(etcd.endpoints)
            host = Host(store, peers, peers, Path(tempfile.mkdtemp()) / "bench.jsonl",
                        group_size=8, max_concurrent=args.max_concurrent)
            runner = host.runner
            if not args.no_freeze:
                import gc

                gc.freeze()  # as EnvHost.setup does
            wait(lambda: runner.acked >= 500, 120)
            prof = None
            if args.profile:
                import cProfile

                prof = cProfile.Profile()
                runner.loop.call_soon_threadsafe(prof.enable)
            gc_time = _gc_timer()
            a0, c0, t0, th0 = runner.acked, cpu_s(), time.monotonic(), thread_cpu()
            wait(lambda: runner.acked >= a0 + args.n, 600)
            a1, c1, t1, th1 = runner.acked, cpu_s(), time.monotonic(), thread_cpu()
            if prof is not None:
                done = threading.Event()
                runner.loop.call_soon_threadsafe(lambda: (prof.disable(), done.set()))
                done.wait(5)
                prof.dump_stats(args.profile)
            host.stop()
            store.close()
    finally:
        if child.stdin:
            child.stdin.close()
        child.wait(10)
    n = a1 - a0
    print(f"env-host: {(c1 - c0) / n * 1e3:.3f} CPU-ms per trajectory ({n} trajectories, "
          f"{n / (t1 - t0):.0f}/s, CPU {(c1 - c0) / (t1 - t0) * 100:.0f}% of a core)")
    print(f"  garbage collector: {gc_time['s'] / n * 1e3:.3f} ms per trajectory in "
          f"{gc_time['n']} collections ({gc_time['gen2']} of generation 2)")
    split = {k: th1.get(k, 0.0) - th0.get(k, 0.0) for k in th1}
    print("  by thread (CPU-ms/trajectory): " + ", ".join(
        f"{k} {v / n * 1e3:.3f}" for k, v in sorted(split.items(), key=lambda kv: -kv[1]) if v > 0))


if __name__ == "__main__":
    main()
