"""The coordinator's side: relays in network namespaces (or on loopback), the pushes it
times for each method, the repair after a kill, and the machine it ran on."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from rlfleet.tools.bench.relay.worker import MIB


class Netns:
    """n namespaces on one bridge: the coordinator at .1, relay i at .(10 + i)."""

    def __init__(self, n: int) -> None:
        tag = os.getpid() % 10000
        self.prefix, self.n = f"rlb{tag}", n
        self.subnet = f"10.213.{tag % 250}"
        self.bridge = f"{self.prefix}br"
        self.names = [f"{self.prefix}n{i}" for i in range(n)]

    @staticmethod
    def available() -> str | None:
        """None if usable, else why not."""
        if os.geteuid() != 0:
            return "not root"
        if shutil.which("ip") is None:
            return "no `ip` command"
        probe = f"rlbprobe{os.getpid() % 10000}"
        r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if r.returncode:
            return f"`ip netns add` failed: {r.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return None

    def _ip(self, *args: str, ns: str | None = None) -> None:
        cmd = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    def up(self) -> Netns:
        try:
            return self._up()
        except (subprocess.CalledProcessError, OSError):
            self.down()  # a half-built set (the kernel may lack veth or bridge) would outlive us
            raise

    def _up(self) -> Netns:
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")
        for i, ns in enumerate(self.names):
            host_end, ns_end = f"{self.prefix}h{i}", f"{self.prefix}v{i}"
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
            self._ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            self._ip("link", "set", ns_end, "netns", ns)
            self._ip("link", "set", host_end, "master", self.bridge, "up")
            self._ip("addr", "add", f"{self.subnet}.{10 + i}/24", "dev", ns_end, ns=ns)
            self._ip("link", "set", ns_end, "up", ns=ns)
            self._ip("link", "set", "lo", "up", ns=ns)
        return self

    def down(self) -> None:
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def ifname(self, i: int) -> str:
        return f"{self.prefix}v{i}"


# ----------------------------------------------------------- coordinator
class Workers:
    def __init__(self, p: int, transport: str, window: int, store_and_forward: bool, netns: Netns | None,
                 shm_root: str) -> None:
        self.procs: list[subprocess.Popen] = []
        self.addresses: dict[str, str] = {}
        for i in range(p):
            rid = f"relay-{i}"
            bind = netns.addr(i) if netns else "127.0.0.1"
            cmd = [sys.executable, "-m", "rlfleet.tools.bench.relay", "worker", "--id", rid, "--bind", bind,
                   "--transport", transport, "--window", str(window), "--store-dir", f"{shm_root}/{rid}"]
            if store_and_forward:
                cmd.append("--store-and-forward")
            env = dict(os.environ)
            if netns:
                cmd = ["ip", "netns", "exec", netns.names[i]] + cmd
                env["GLOO_SOCKET_IFNAME"] = netns.ifname(i)
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                               env=env, start_new_session=True))
        for i in range(len(self.procs)):
            self.addresses[f"relay-{i}"] = self.recv(i)["address"]
        self.order = [f"relay-{i}" for i in range(p)]
        self._locks = [threading.Lock() for _ in range(p)]  # one request at a time per worker

    def send(self, i: int, **cmd: Any) -> None:
        self.procs[i].stdin.write(json.dumps(cmd) + "\n")
        self.procs[i].stdin.flush()

    def recv(self, i: int) -> dict[str, Any]:
        line = self.procs[i].stdout.readline()
        if not line:
            raise RuntimeError(f"bench worker relay-{i} exited (code {self.procs[i].poll()})")
        return json.loads(line)

    def ask(self, i: int, **cmd: Any) -> dict[str, Any]:
        with self._locks[i]:
            self.send(i, **cmd)
            return self.recv(i)

    def set_chain(self, order: list[str]) -> None:
        alive = {r: a for r, a in self.addresses.items() if r in order}
        for rid in order:
            self.ask(int(rid.split("-")[1]), op="chain", order=order, addresses=alive)

    def close(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc.poll() is None:
                try:
                    self.send(i, op="quit")
                except (BrokenPipeError, OSError):
                    pass
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _push_versions(workers: Workers, data: np.ndarray, chunk: int, reps: int, window: int) -> list[tuple[float, float]]:
    """(broadcast seconds, trainer stall seconds) per rep."""
    from rlfleet.common.job_secret import job_secret_from_env
    from rlfleet.relay.link import Link
    from rlfleet.relay.manifest import build_manifest
    from rlfleet.relay.publisher import _FullSource
    from rlfleet.relay.transport import transport_for

    addr = workers.addresses["relay-0"]
    link = Link(transport_for(addr, job_secret_from_env()).connect(addr, 10), "bench-trainer", role="publisher",
                window=window, reply_timeout_s=120)
    out = []
    try:
        for rep in range(reps):
            manifest, src = build_manifest(rep + 1, {"w": data}, chunk_bytes=chunk)
            t0 = time.time()
            link.push(manifest, _FullSource(manifest, src))
            stall = time.time() - t0
            ends = [workers.ask(int(r.split("-")[1]), op="wait", version=rep + 1, timeout=600)
                    for r in workers.order]
            if not all(e["ok"] for e in ends):
                raise RuntimeError(f"version {rep + 1} did not reach every relay")
            out.append((max(e["completed_wall"] for e in ends) - t0, stall))
            for r in workers.order:  # memory: hold one version per relay at a time
                workers.ask(int(r.split("-")[1]), op="clear")
    finally:
        link.close()
    return out


def run_chain(p: int, data: np.ndarray, chunk: int, reps: int, a: argparse.Namespace, netns: Netns | None,
              store_and_forward: bool, transport: str) -> list[tuple[float, float]]:
    shm = tempfile.mkdtemp(prefix="rlfleet-bench-", dir="/dev/shm")
    workers = Workers(p, transport, a.window, store_and_forward, netns, shm)
    try:
        workers.set_chain(workers.order)
        return _push_versions(workers, data, chunk, reps, a.window)
    finally:
        workers.close()
        shutil.rmtree(shm, ignore_errors=True)


def run_gloo(p: int, size: int, reps: int, a: argparse.Namespace, netns: Netns | None) -> list[float]:
    import socket

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    host = f"{netns.subnet}.1" if netns else "127.0.0.1"
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    # Gloo picks its interface from the hostname unless told; a machine without a network (or
    # whose hostname does not resolve) then fails, so on loopback name `lo` (an explicit setting wins).
    set_ifname = netns is not None or "GLOO_SOCKET_IFNAME" not in os.environ
    if set_ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = netns.bridge if netns else "lo"
    shm = tempfile.mkdtemp(prefix="rlfleet-bench-", dir="/dev/shm")
    workers = Workers(p, "tcp", a.window, False, netns, shm)
    init = f"tcp://{host}:{port}"
    try:
        for i in range(p):
            workers.send(i, op="gloo", init=init, rank=i + 1, world=p + 1, size=size, reps=reps)
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=p + 1)
        buf = torch.from_numpy(np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8))
        starts = []
        for _ in range(reps):
            dist.barrier()
            starts.append(time.time())
            dist.broadcast(buf, src=0)
        ends = [workers.recv(i)["ends"] for i in range(p)]
        dist.destroy_process_group()
        return [max(e[r] for e in ends) - starts[r] for r in range(reps)]
    finally:
        workers.close()
        shutil.rmtree(shm, ignore_errors=True)
        if set_ifname:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)


def run_link(data: np.ndarray, reps: int, a: argparse.Namespace, netns: Netns | None) -> list[float]:
    """A plain socket copy of the same bytes to one process: the link's ceiling."""
    import socket

    shm = tempfile.mkdtemp(prefix="rlfleet-bench-", dir="/dev/shm")
    workers = Workers(1, "tcp", a.window, False, netns, shm)
    out = []
    try:
        view = memoryview(data).cast("B")
        for _ in range(reps):
            host, port = workers.ask(0, op="sink", size=len(view))["address"]
            with socket.create_connection((host, port)) as s:
                t0 = time.time()
                for off in range(0, len(view), 8 * MIB):
                    s.sendall(view[off:off + 8 * MIB])
                out.append(workers.recv(0)["done_wall"] - t0)
    finally:
        workers.close()
        shutil.rmtree(shm, ignore_errors=True)
    return out


def run_repair(data: np.ndarray, chunk: int, a: argparse.Namespace, netns: Netns | None) -> dict[str, Any]:
    """Kill -9 relay 1 of 4 mid-broadcast; how long until chunks flow again, and from where."""
    p = 4
    shm = tempfile.mkdtemp(prefix="rlfleet-bench-", dir="/dev/shm")
    workers = Workers(p, a.transports[0], a.window, False, netns, shm)
    try:
        workers.set_chain(workers.order)
        result: dict[str, Any] = {}
        pusher = threading.Thread(target=lambda: result.update(
            times=_push_versions(_Survivors(workers, skip="relay-1"), data, chunk, 1, a.window)))
        pusher.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            prog = (workers.ask(2, op="stats").get("progress") or {}).get("1/tp1", [0, 1])
            if prog[0] >= max(1, prog[1] // 4):
                break
            time.sleep(0.005)
        killed_at = time.time()
        os.killpg(workers.procs[1].pid, signal.SIGKILL)
        pusher.join()
        repairs = workers.ask(0, op="stats")["repairs"]
        return {"p": p, "size_bytes": data.nbytes, "chunk_bytes": chunk, "killed": "relay-1",
                "killed_after_chunks_at_relay_2": prog[0], "repair_s": repairs[-1]["repair_s"] if repairs else None,
                "resumed_from_chunk": repairs[-1]["resumed_from_chunk"] if repairs else None,
                "broadcast_s": result.get("times", [(None,)])[0][0], "killed_wall": killed_at}
    finally:
        workers.close()
        shutil.rmtree(shm, ignore_errors=True)


class _Survivors:
    """The Workers view the push loop waits on, without the relay we are about to kill."""

    def __init__(self, workers: Workers, skip: str) -> None:
        self.w, self.addresses = workers, workers.addresses
        self.order = [r for r in workers.order if r != skip]

    def ask(self, i: int, **cmd: Any) -> dict[str, Any]:
        return self.w.ask(i, **cmd)


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def _shm_free_bytes() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


def _fits(method: str, p: int, size: int) -> bool:
    """Leave the machine's other users room: skip a run whose peak would not fit twice over.

    The chain's stores are files in /dev/shm (one version per relay at a time), and a
    tmpfs smaller than RAM (a container's or VM's default) would SIGBUS a relay mid-copy."""
    per_proc = (450 if method == "gloo" else 120) * MIB  # interpreter (+ torch for gloo)
    need = (p + 1) * (size + per_proc)
    if method != "gloo" and p * size + 64 * MIB > _shm_free_bytes():
        return False
    return 2 * need < _available_bytes()


def machine_info(label: str | None) -> dict[str, Any]:
    """What the figures were measured on (docs/results/relay.md names it with every table)."""
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    with open("/proc/meminfo") as f:
        mem = next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemTotal:")), 0)
    return {"label": label, "cpus": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "cpu_model": model, "mem_total_gib": round(mem / (1 << 30), 1), "dev_shm_free_gib":
            round(_shm_free_bytes() / (1 << 30), 1), "kernel": platform.release(),
            "python": platform.python_version(), "load_avg": os.getloadavg()}
