"""Private etcd processes on loopback: the embedded fleet's etcd, and test clusters.

Real etcd binaries (Debian's etcd-server), free ports, a temporary data dir.
Members that lost quorum may ignore SIGTERM (FINDINGS), so `stop()` escalates
to SIGKILL after a grace period.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rlfleet.common.procs import with_parent_death

if TYPE_CHECKING:
    from rlfleet.tools.run.credentials import EtcdTls

INSTALL_HINT = ("etcd is not installed. On Debian/Ubuntu as root: "
                "apt-get install -y etcd-server etcd-client (or put an etcd 3.4+ binary on PATH)")


# The same as Ansible's etcd members (ansible's cluster_defaults etcd_compaction_retention). A watch away
# longer than this loses the events it missed (common/control/etcd_store.py logs it as an error);
# a daemon away that long has lost its 3 s lease and registered again anyway.
COMPACTION_RETENTION = "10m"


def etcd_binary() -> str:
    path = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if path is None:
        raise FileNotFoundError(INSTALL_HINT)
    return path


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_HANDED_OUT: set[int] = set()  # never the same port twice in one process (a member's two ports)


def free_port() -> int:
    """A port etcd can be told to listen on, free now and outside the kernel's ephemeral range:
    a port found free inside it (bind to 0) can be taken by any process's outgoing connection
    before etcd binds it (seen with two test workers: "bind: address already in use")."""
    low, high = _ephemeral_range()
    pool = range(10_000, low) if low - 10_000 >= 4_096 else range(high + 1, 65_536)
    for port in random.sample(pool, min(len(pool), 200)):
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    raise OSError(f"no free port in {pool.start}-{pool.stop - 1} (outside the ephemeral range {low}-{high})")


@dataclass
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen | None = None
    # Joins a running cluster (after `etcdctl member add`): --initial-cluster-state existing.
    joining: bool = False

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class EtcdCluster:
    """n etcd members on loopback. `EtcdCluster(1)` is the embedded single node."""

    size: int = 1
    base_dir: Path | None = None
    # Fast elections: a loopback cluster needs no WAN-grade timeouts, and tests
    # of leader loss finish in a fraction of a second instead of several.
    heartbeat_ms: int = 10
    election_ms: int = 100
    members: list[EtcdMember] = field(default_factory=list)
    # TLS on the client port, and only clients with a certificate from the same CA
    # (--client-cert-auth); None: plain http, anyone who can reach the port.
    tls: EtcdTls | None = None
    # History kept before etcd compacts it (etcd's periodic auto-compaction): a job writes
    # all the time (progress, claims, heartbeats), and an etcd never compacted keeps every
    # revision in memory and on disk until its quota stops all writes.
    compaction_retention: str = COMPACTION_RETENTION
    _own_dir: bool = False

    def __post_init__(self) -> None:
        if self.base_dir is None:
            self.base_dir = Path(tempfile.mkdtemp(prefix="rlfleet-etcd-"))
            self._own_dir = True
        self.base_dir.mkdir(parents=True, exist_ok=True)
        for i in range(self.size):
            name = f"m{i}"
            self.members.append(EtcdMember(name, free_port(), free_port(),
                                           self.base_dir / f"{name}.etcd", self.base_dir / f"{name}.log"))

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    @property
    def endpoints_arg(self) -> str:
        return ",".join(self.endpoints)

    def _cmd(self, m: EtcdMember, state: str) -> list[str]:
        initial = ",".join(f"{x.name}={x.peer_url}" for x in self.members)
        scheme = "https" if self.tls else "http"
        tls = [] if self.tls is None else [
            "--cert-file", str(self.tls.server_cert), "--key-file", str(self.tls.server_key),
            "--trusted-ca-file", str(self.tls.ca), "--client-cert-auth"]
        return [etcd_binary(), "--name", m.name, "--data-dir", str(m.data_dir),
                "--listen-client-urls", f"{scheme}://{m.endpoint}",
                "--advertise-client-urls", f"{scheme}://{m.endpoint}", *tls,
                "--listen-peer-urls", m.peer_url, "--initial-advertise-peer-urls", m.peer_url,
                "--initial-cluster", initial, "--initial-cluster-state", state,
                "--initial-cluster-token", f"rlfleet-{id(self):x}",
                "--heartbeat-interval", str(self.heartbeat_ms),
                "--election-timeout", str(self.election_ms),
                "--auto-compaction-mode", "periodic",
                "--auto-compaction-retention", self.compaction_retention,
                "--log-level", "warn"]

    def start(self, timeout_s: float = 20.0) -> EtcdCluster:
        for m in self.members:
            self.start_member(m, wait=False)
        self.wait_healthy(timeout_s)
        return self

    def start_member(self, m: EtcdMember, wait: bool = True, timeout_s: float = 20.0) -> None:
        state = "existing" if m.data_dir.exists() or m.joining else "new"
        log = open(m.log_path, "ab")
        m.proc = subprocess.Popen(with_parent_death(self._cmd(m, state), signal.SIGKILL), stdout=log,
                                  stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        if wait:
            self.wait_healthy(timeout_s, members=[m])

    def wait_healthy(self, timeout_s: float = 20.0, members: list[EtcdMember] | None = None) -> None:
        """Until every given member answers a linearizable read (so quorum exists)."""
        import ssl
        import urllib.request
        deadline = time.monotonic() + timeout_s
        scheme, context = "http", None
        if self.tls is not None:
            scheme, context = "https", ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        for m in members or self.members:
            while True:
                if m.proc is not None and m.proc.poll() is not None:
                    raise RuntimeError(f"etcd member {m.name} exited with {m.proc.returncode}; "
                                       f"log: {m.log_path}\n{m.log_path.read_text()[-2000:]}")
                try:
                    with urllib.request.urlopen(f"{scheme}://{m.endpoint}/health", timeout=1, context=context) as r:
                        if b'"true"' in r.read():
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"etcd member {m.name} not healthy after {timeout_s}s; log: {m.log_path}")
                time.sleep(0.05)

    def forget_member(self, m: EtcdMember) -> None:
        """Drop a member (killed, and removed from etcd with `etcdctl member remove`) from
        this object: it leaves the --initial-cluster of members added later; its data goes."""
        self.kill_member(m)
        self.members.remove(m)
        shutil.rmtree(m.data_dir, ignore_errors=True)

    def new_member(self, name: str, client_port: int | None = None, peer_port: int | None = None) -> EtcdMember:
        """A member that will join the running cluster, not started: first tell etcd with
        `etcdctl member add NAME --peer-urls=<its peer_url> [--learner]`, then
        `start_member` (the --initial-cluster is every member here, as member add prints it).
        Ports default to free ones; a replacement may take over the ports of the member it replaces."""
        m = EtcdMember(name, client_port or free_port(), peer_port or free_port(),
                       self.base_dir / f"{name}-{len(self.members)}.etcd", self.base_dir / f"{name}.log",
                       joining=True)
        self.members.append(m)
        return m

    def kill_member(self, m: EtcdMember) -> None:
        if m.alive():
            m.proc.kill()
            m.proc.wait()

    def stop_member(self, m: EtcdMember, grace_s: float = 3.0) -> None:
        if not m.alive():
            return
        m.proc.send_signal(signal.SIGTERM)
        try:
            m.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            m.proc.kill()
            m.proc.wait()

    def stop(self) -> None:
        for m in self.members:
            self.stop_member(m)
        if self._own_dir and self.base_dir is not None:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
