"""Relay-chain benchmark: pipelined chain vs store-and-forward vs gloo broadcast vs the raw link.

    python -m rlfleet.tools.bench.relay --size-mib 256,1024 --relays 1,2,4,8 --json OUT
    python -m rlfleet.tools.bench.relay plot OUT [OUT2 ...] --png FIG.png

Every relay is its own process (a `RelayNode`, the relay daemon's data plane,
without etcd: the coordinator hands it the chain); the coordinator plays the
trainer and pushes each version to relay 0. With root and `ip netns`, each
relay runs in its own network namespace behind a veth pair on one bridge (a
stand-in for machines); otherwise everything runs on loopback and the summary
says so.

Output: a JSON list of records {method, transport, p, size_bytes, chunk_bytes,
seconds, ...} with method in chain | store_forward | gloo | link (`seconds`:
from the trainer's first byte to the last relay holding the whole version;
chain records also carry `stall_s`, the trainer's wait), and a summary next to
it (OUT with .summary.json) with T(p)/T(1), the Appendix C fit
T(p, k) = (p + k - 1)(M/k T_byte + T_start) (p relays plus the trainer = p + 1
nodes), the repair time after a relay is killed mid-broadcast, and the machine
it ran on (`--machine` names it; cores, CPU model, memory are read).
If the namespaces cannot be set up (no `ip`, no veth or bridge in the kernel),
the run falls back to loopback and the summary says why.

`plot` draws seconds vs p per method and the trainer's stall vs p, one row per
version size, from record files (a plain list, or {"records": [...]}). A record
marked {"excluded": why} afterwards is kept in the file but left out of medians,
fits and plots.

With RLFLEET_JOB_SECRET_FILE set, every hop (and the trainer's link) is
authenticated (relay.auth): run it with and without to see what that costs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

MIB = 1 << 20


# ----------------------------------------------------------------- worker
def worker_main(args: argparse.Namespace) -> int:
    """One relay process, driven by JSON lines on stdin (replies on stdout)."""
    from rlfleet.common.job_secret import job_secret_from_env
    from rlfleet.relay.node import NodeConfig, RelayNode
    from rlfleet.relay.topology import ChainView, RelayMember

    node = RelayNode(NodeConfig(args.id, args.store_dir, transport=args.transport, bind_host=args.bind,
                                window_chunks=args.window, keep_versions=1,
                                store_and_forward=args.store_and_forward, secret=job_secret_from_env())).start()
    out = sys.stdout

    def reply(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    reply({"address": node.address})
    pg = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "chain":
            members = {rid: RelayMember(rid, "", addr, "", -1, "running", 1.0) for rid, addr in cmd["addresses"].items()}
            node.set_chain(ChainView(cmd["order"][0], tuple(cmd["order"]), members))
            reply({"ok": True})
        elif op == "wait":
            deadline = time.monotonic() + cmd["timeout"]
            obj = None
            while time.monotonic() < deadline:
                obj = node.store.get((cmd["version"], 1))
                if obj is not None and obj.complete:
                    break
                time.sleep(0.002)
            done = obj is not None and obj.complete
            reply({"ok": done, "completed_wall": obj.completed_wall if done else None})
        elif op == "clear":  # free every version, so the next rep starts from an empty store
            with node.store.cond:
                for key, obj in list(node.store.objects.items()):
                    if obj.refs == 0 and node.store._try_free(obj):
                        del node.store.objects[key]
            reply({"ok": True})
        elif op == "stats":
            reply(node.stats())
        elif op == "gloo":
            import torch
            import torch.distributed as dist

            torch.set_num_threads(1)
            if pg is None:
                dist.init_process_group("gloo", init_method=cmd["init"], rank=cmd["rank"], world_size=cmd["world"])
                pg = True
            buf = torch.empty(cmd["size"], dtype=torch.uint8)
            ends = []
            for _ in range(cmd["reps"]):
                dist.barrier()
                dist.broadcast(buf, src=0)
                ends.append(time.time())
            reply({"ends": ends})
        elif op == "sink":
            import socket

            srv = socket.socket()
            srv.bind((args.bind, 0))
            srv.listen(1)
            reply({"address": srv.getsockname()})
            conn, _ = srv.accept()
            buf = bytearray(cmd["size"])
            view, got = memoryview(buf), 0
            while got < len(buf):
                got += conn.recv_into(view[got:], min(len(buf) - got, 8 * MIB))
            reply({"done_wall": time.time()})
            conn.close()
            srv.close()
        elif op == "quit":
            break
    node.stop()
    return 0


# ------------------------------------------------------------ namespaces
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


# ------------------------------------------------------------- analysis
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


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["plot"]:
        pp = argparse.ArgumentParser(prog="relay plot")
        pp.add_argument("records", nargs="+", help="record files written by --json")
        pp.add_argument("--png", required=True)
        pp.add_argument("--title", default="")
        pa = pp.parse_args(argv[1:])
        plot([r for f in pa.records for r in _load_records(f)], pa.png, pa.title)
        return 0
    if argv[:1] == ["worker"]:
        wp = argparse.ArgumentParser()
        for flag in ("--id", "--bind", "--transport", "--store-dir"):
            wp.add_argument(flag, required=True)
        wp.add_argument("--window", type=int, default=4)
        wp.add_argument("--store-and-forward", action="store_true")
        return worker_main(wp.parse_args(argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", default="256,1024")
    ap.add_argument("--relays", default="1,2,4,8")
    ap.add_argument("--chunk-mib", default="32", help="chunk size(s) for the p sweep")
    ap.add_argument("--fit-chunk-mib", default="4,16,64", help="chunk sizes of the p=1 runs the fit uses")
    ap.add_argument("--methods", default="chain,store_forward,gloo,link")
    ap.add_argument("--transports", default="tcp", help="tcp and/or ucx for the chain")
    ap.add_argument("--net", choices=("auto", "loopback", "netns", "both"), default="both")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--no-repair", action="store_true")
    ap.add_argument("--machine", default=None, help="a name for the machine, kept in the summary")
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    a.transports = a.transports.split(",")
    sizes = [int(s) * MIB for s in a.size_mib.split(",")]
    ps = [int(p) for p in a.relays.split(",")]
    chunks = [int(c) * MIB for c in a.chunk_mib.split(",")]
    fit_chunks = [int(c) * MIB for c in a.fit_chunk_mib.split(",")] if a.fit_chunk_mib else []
    methods = a.methods.split(",")
    why_not = Netns.available() if a.net in ("auto", "netns", "both") else "not requested"
    nets = {"loopback": ["loopback"], "netns": ["netns"], "both": ["loopback", "netns"],
            "auto": ["netns"]}[a.net]
    if why_not is not None and "netns" in nets:
        print(f"note: network namespaces unavailable ({why_not}); loopback only", file=sys.stderr)
        nets = ["loopback"]
    summary: dict[str, Any] = {"cpus": os.cpu_count(), "machine": machine_info(a.machine), "nets": nets,
                               "netns_unavailable": why_not, "repair": [], "skipped": []}
    records: list[dict[str, Any]] = []

    def emit(rec: dict[str, Any]) -> None:
        records.append(rec)
        print(json.dumps(rec), flush=True)
        Path(a.json).write_text(json.dumps(records, indent=1))

    for net in list(nets):
        ns = None
        if net == "netns":
            try:
                ns = Netns(max(ps)).up()
            except (subprocess.CalledProcessError, OSError) as e:
                why = getattr(e, "stderr", None) or str(e)
                summary["netns_unavailable"] = f"setup failed: {str(why).strip()}"
                print(f"note: network namespaces could not be set up ({why}); loopback instead", file=sys.stderr)
                nets.remove("netns")
                if "loopback" in nets:
                    continue
                net = "loopback"
                nets.append(net)
        try:
            for size in sizes:
                data = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
                base = {"size_bytes": size, "net": net}
                if "link" in methods:
                    for t in run_link(data, a.reps, a, ns):
                        emit({"method": "link", "transport": "tcp", "p": 1, "chunk_bytes": size, "seconds": t, **base})
                for tr in a.transports:
                    for chunk in chunks:
                        for p in ps:
                            for m in ("chain", "store_forward"):
                                if m in methods and not _fits(m, p, size):
                                    summary["skipped"].append(f"{m} p={p} {size // MIB} MiB {net}: not enough free memory")
                                elif m in methods:
                                    for t, stall in run_chain(p, data, chunk, a.reps, a, ns, m == "store_forward", tr):
                                        emit({"method": m, "transport": tr, "p": p, "chunk_bytes": chunk,
                                              "seconds": t, "stall_s": stall, **base})
                    if "chain" in methods:
                        for chunk in fit_chunks:
                            if chunk not in chunks:
                                for t, stall in run_chain(1, data, chunk, a.reps, a, ns, False, tr):
                                    emit({"method": "chain", "transport": tr, "p": 1, "chunk_bytes": chunk,
                                          "seconds": t, "stall_s": stall, **base})
                if "gloo" in methods:
                    for p in ps:
                        if not _fits("gloo", p, size):
                            summary["skipped"].append(f"gloo p={p} {size // MIB} MiB {net}: not enough free memory")
                            continue
                        for t in run_gloo(p, size, a.reps, a, ns):
                            emit({"method": "gloo", "transport": "tcp", "p": p, "chunk_bytes": size,
                                  "seconds": t, **base})
                if not a.no_repair and size == sizes[0] and max(ps) >= 4:
                    summary["repair"].append({**run_repair(data, 4 * MIB, a, ns), "net": net})
                del data
        finally:
            if ns is not None:
                ns.down()
    summary["by_config"] = summarize(records)
    summary["appendix_c_fit"] = {net: fit_appendix_c([r for r in records if r["net"] == net]) for net in nets}
    Path(a.json).with_suffix(".summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps({k: summary[k] for k in ("repair", "appendix_c_fit")}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
