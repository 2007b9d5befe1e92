"""The `Lab`: N systemd hosts booted with systemd-nspawn, each on the lab's bridge.

A host is an overlay over the cached base (upper = its disk, kept until `down`), its own
network namespace, and one `systemd-nspawn --boot` process. Powering it off kills the
container's PID 1 (all its processes die at once, no shutdown runs: a pulled plug);
`start` boots the same overlay again. `down` asks every host to power off cleanly
(SIGTERM to nspawn makes the container's systemd shut down), kills what is left after
its deadline, and removes mounts, namespaces and the lab's directory.

nspawn flags (FINDINGS): `--register=no --keep-unit` since this machine's PID 1 is not
systemd (no machined, no system bus); so `machinectl` does not see the hosts, and
commands reach them by `nsenter` into the container's PID 1 or by SSH.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet.tools.lab import cgroups, net, procs
from rlfleet.tools.lab.commands import run, say
from rlfleet.tools.lab.files import HostState, LabState, etc_hosts, inventory, known_hosts, ssh_config
from rlfleet.tools.lab.paths import HOST_RE, KEY, ROOTFS, WHEELHOUSE, check_name, host_netns, lab_dir
from rlfleet.tools.lab.rootfs import cached as rootfs_cached

CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ANSIBLE_PROGRAMS = ("ansible", "ansible-playbook", "ansible-inventory", "ansible-console")


class LabError(RuntimeError):
    pass


@dataclass
class Ready:
    host: str
    system: str                      # "running" or "degraded"
    failed_units: list[str] = field(default_factory=list)
    seconds: float = 0.0


class Lab:
    def __init__(self, name: str):
        self.name = check_name(name)
        self.dir = lab_dir(name)
        self.state = LabState.load(self.dir)

    # -- bringing hosts up -----------------------------------------------------------
    def up(self, hosts: int, subnet: str = "10.210.0", timeout: float = 180.0) -> list[Ready]:
        if not 1 <= hosts <= 99:
            raise LabError(f"--hosts must be 1..99, got {hosts}")
        if self.state and any(self._running(h) for h in self.state.hosts.values()):
            raise LabError(f"lab {self.name} is up ({self.dir}): `down --name {self.name}` first")
        if rootfs_cached(KEY.with_suffix(".pub").read_text().strip() if KEY.exists() else "") is None:
            raise LabError(f"no complete base rootfs at {ROOTFS}: run `python -m rlfleet.tools.lab build`")
        self.down(quiet=True)  # the remains of a crashed lab of that name, if any
        self.dir.mkdir(parents=True)
        shutil.copy(KEY, self.dir / "id_ed25519")
        os.chmod(self.dir / "id_ed25519", 0o600)
        self.state = LabState(self.name, subnet, str(self.dir), {
            f"h{i}": HostState(f"h{i}", f"{subnet}.{i}", host_netns(self.name, f"h{i}")) for i in range(1, hosts + 1)})
        self.state.save()
        net.ensure_bridge(self.name, subnet)
        keys = {h.name: self._prepare_disk(h) for h in self.state.hosts.values()}
        (self.dir / "known_hosts").write_text(known_hosts(self.state, keys))
        (self.dir / "ssh_config").write_text(ssh_config(self.state))
        (self.dir / "inventory.ini").write_text(inventory(self.state))
        deadline = time.monotonic() + timeout
        for h in self.state.hosts.values():
            self._boot(h)
        return [self._wait_ready(h, deadline) for h in self.state.hosts.values()]

    def add_host(self, timeout: float = 120.0) -> Ready:
        """Boot one more host, h<N+1>, beside the running ones (a machine joining a live
        job): the lab's known_hosts, ssh_config and inventory, and every host's /etc/hosts,
        name it from now on."""
        if not self.state or not any(self._running(h) for h in self.state.hosts.values()):
            raise LabError(f"lab {self.name} is not up: `up --name {self.name}` first")
        n = max(int(name[1:]) for name in self.state.hosts) + 1
        if n > 99:
            raise LabError(f"lab {self.name} has h99 already: a lab holds at most 99 hosts")
        h = self.state.hosts[f"h{n}"] = HostState(f"h{n}", f"{self.state.subnet}.{n}", host_netns(self.name, f"h{n}"))
        self.state.save()
        keys = {other.name: self._prepare_disk(other) for other in self.state.hosts.values()}  # rewrites /etc/hosts
        (self.dir / "known_hosts").write_text(known_hosts(self.state, keys))
        (self.dir / "ssh_config").write_text(ssh_config(self.state))
        (self.dir / "inventory.ini").write_text(inventory(self.state))
        self._boot(h)
        return self._wait_ready(h, time.monotonic() + timeout)

    def start(self, host: str, timeout: float = 120.0) -> Ready:
        h = self._host(host)
        if self._running(h):
            raise LabError(f"{host} is already running (nspawn pid {h.nspawn_pid})")
        self._prepare_disk(h)
        self._boot(h)
        return self._wait_ready(h, time.monotonic() + timeout)

    def _prepare_disk(self, h: HostState) -> list[str]:
        """Mount the host's overlay; on its first boot give it its own identity. Returns its host keys."""
        hd = self.dir / "hosts" / h.name
        for sub in ("upper", "work", "merged"):
            (hd / sub).mkdir(parents=True, exist_ok=True)
        merged = hd / "merged"
        if not os.path.ismount(merged):
            run(["mount", "-t", "overlay", "overlay", "-o",
                 f"lowerdir={ROOTFS},upperdir={hd / 'upper'},workdir={hd / 'work'}", str(merged)])
        etc = merged / "etc"
        if not (etc / "machine-id").read_text().strip():
            (etc / "machine-id").write_text(uuid.uuid4().hex + "\n")  # else every host has one machine-id
        (etc / "hostname").write_text(h.name + "\n")
        (etc / "hosts").write_text(etc_hosts(self.state))
        if not list((etc / "ssh").glob("ssh_host_*_key")):
            run(["ssh-keygen", "-A", "-f", str(merged)])  # this host's own host keys
        return [" ".join(p.read_text().split()[:2]) for p in sorted((etc / "ssh").glob("ssh_host_*_key.pub"))]

    def _boot(self, h: HostState) -> None:
        hd = self.dir / "hosts" / h.name
        net.ensure_host_link(self.name, h.netns, f"v{h.name}", h.ip, self.state.gateway)
        cmd = ["systemd-nspawn", "-D", str(hd / "merged"), "--boot", f"--machine={h.name}", "--register=no",
               "--keep-unit", f"--network-namespace-path={net.NETNS_DIR / h.netns}", "--console=read-only",
               "--link-journal=no"]
        if WHEELHOUSE.is_dir():
            cmd.append(f"--bind-ro={WHEELHOUSE}:/srv/wheelhouse")
        with open(hd / "console.log", "ab") as log:
            log.write(f"\n--- boot {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n".encode())
            log.flush()
            # Own session: a Ctrl-C in the terminal that ran `up` does not power the lab off.
            # Own cgroup: see cgroups.py (hosts sharing one raced and booted degraded).
            proc = subprocess.Popen(cgroups.joined(cgroups.make(self.name, h.name), cmd), stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        h.nspawn_pid, h.leader_pid = proc.pid, 0
        self.state.save()

    def _wait_ready(self, h: HostState, deadline: float) -> Ready:
        """Until the host's systemd finished booting and its sshd answers, or the deadline."""
        t0 = time.monotonic()
        while not h.leader_pid:
            self._check_alive(h)
            h.leader_pid = procs.find_leader(net.NETNS_DIR / h.netns)
            self._check_deadline(h, deadline, "its systemd to start")
            time.sleep(0.05)
        self.state.save()
        system = ""
        while system not in ("running", "degraded"):
            self._check_alive(h)
            self._check_deadline(h, deadline, "systemd to finish booting")
            try:  # --wait blocks until boot ends; before systemd listens it fails at once
                system = self._nsenter(h, ["systemctl", "is-system-running", "--wait"],
                                       timeout=max(1.0, deadline - time.monotonic())).stdout.strip()
            except subprocess.TimeoutExpired:
                continue
            if system not in ("running", "degraded"):
                time.sleep(0.1)
        failed = []
        if system == "degraded":
            failed = self._nsenter(h, ["systemctl", "--failed", "--plain", "--no-legend", "--no-pager"]).stdout.split("\n")
            failed = [line.split()[0] for line in failed if line.strip()]
        while self.ssh(h.name, ["true"], capture=True, connect_timeout=2).returncode != 0:
            self._check_alive(h)
            self._check_deadline(h, deadline, "sshd to answer")
            time.sleep(0.1)
        ready = Ready(h.name, system, failed, round(time.monotonic() - t0, 2))
        say(f"{h.name} {h.ip}: {system}" + (f" (failed: {' '.join(failed)})" if failed else "")
            + f", ssh ok, {ready.seconds:.1f} s")
        return ready

    def _check_alive(self, h: HostState) -> None:
        if not procs.alive(h.nspawn_pid):
            tail = (self.dir / "hosts" / h.name / "console.log").read_text(errors="replace")[-3000:]
            raise LabError(f"{h.name}: systemd-nspawn exited during boot; console.log ends:\n{tail}")

    def _check_deadline(self, h: HostState, deadline: float, what: str) -> None:
        if time.monotonic() > deadline:
            raise LabError(f"{h.name}: timed out waiting for {what} (console: {self.dir}/hosts/{h.name}/console.log)")

    # -- powering off, tearing down --------------------------------------------------------
    def poweroff(self, host: str, timeout: float = 10.0) -> None:
        """Pull the plug: SIGKILL the container's PID 1 (the kernel kills the rest of the container),
        then nspawn exits by itself; its disk (the overlay) stays as it was."""
        h = self._host(host)
        if not self._running(h):
            raise LabError(f"{host} is already off")
        leader = h.leader_pid or procs.find_leader(net.NETNS_DIR / h.netns)
        procs.signal_all([leader] if leader else [h.nspawn_pid], procs.KILL)
        if procs.wait_gone([h.nspawn_pid, leader], time.monotonic() + timeout):
            procs.signal_all([h.nspawn_pid], procs.KILL)
            procs.wait_gone([h.nspawn_pid], time.monotonic() + timeout)
        # A machine without power does not answer: no RST from a kernel still holding its address.
        run(["ip", "-n", self.name, "link", "set", f"v{h.name}", "down"], check=False)
        h.nspawn_pid = h.leader_pid = 0
        self.state.save()

    def down(self, timeout: float = 30.0, quiet: bool = False) -> dict[str, list]:
        """Power every host off cleanly, then remove processes, mounts, namespaces and the lab's
        directory. Works from whatever is left (a partial `up`, a crashed test, a second `down`).
        Returns the leftovers (all empty when the lab is gone)."""
        t0 = time.monotonic()
        nspawns = set(procs.nspawn_pids_under(self.dir))
        if self.state:
            nspawns |= {h.nspawn_pid for h in self.state.hosts.values() if procs.alive(h.nspawn_pid)}
        procs.signal_all(sorted(nspawns), procs.TERM)  # nspawn asks the container's systemd to power off
        stuck = procs.wait_gone(sorted(nspawns), time.monotonic() + timeout)
        if stuck:
            say(f"down: {len(stuck)} host(s) still up after {timeout:.0f} s: killing them")
            self._kill_namespaces(hosts_only=True)
            procs.signal_all(stuck, procs.KILL)
            procs.wait_gone(stuck, time.monotonic() + 10)
        self._kill_namespaces(hosts_only=False)  # whatever else runs there (ssh masters, servers)
        strays = cgroups.procs_in(self.name)  # a container whose nspawn died without it
        if strays:
            procs.signal_all(strays, procs.KILL)
            procs.wait_gone(strays, time.monotonic() + 10)
        cgroups.remove(self.name)
        for mount in sorted(self._mounts(), key=len, reverse=True):
            if run(["umount", mount], check=False).returncode != 0:
                run(["umount", "-l", mount], check=False)
        for ns in sorted(net.lab_namespaces(self.name), key=lambda n: n == self.name):
            net.delete_netns(ns)  # the hosts' first, then the lab's with the bridge
        if self.dir.exists() and not self._mounts():
            shutil.rmtree(self.dir)
        self.state = None
        left = self.leftovers()
        if not quiet:
            say(f"down {self.name}: {len(nspawns)} host(s) powered off in {time.monotonic() - t0:.1f} s"
                + (f"; LEFT BEHIND: {left}" if any(left.values()) else "; nothing left behind"))
        return left

    def _kill_namespaces(self, hosts_only: bool) -> None:
        spaces = [ns for ns in net.lab_namespaces(self.name) if not hosts_only or ns != self.name]
        pids = [p for ns in spaces for p in net.netns_pids(ns) if p != os.getpid()]
        if pids:
            procs.signal_all(pids, procs.TERM)
            procs.signal_all(procs.wait_gone(pids, time.monotonic() + 5), procs.KILL)
            procs.wait_gone(pids, time.monotonic() + 5)

    def _mounts(self) -> list[str]:
        prefix = f"{self.dir}/"
        return [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
                if line.split()[1].startswith(prefix)]

    def leftovers(self) -> dict[str, list]:
        """What of this lab still exists on the machine: namespaces, mounts, nspawn processes, its dir."""
        return {"netns": net.lab_namespaces(self.name), "mounts": self._mounts(),
                "processes": procs.nspawn_pids_under(self.dir) + cgroups.procs_in(self.name),
                "cgroups": cgroups.leftovers(self.name), "dir": [str(self.dir)] if self.dir.exists() else []}

    # -- reaching hosts --------------------------------------------------------------------
    def exec_argv(self, host: str, cmd: list[str]) -> list[str]:
        """argv that runs cmd inside the host (all its namespaces), with a clean environment."""
        h = self._host(host)
        if not self._running(h):
            raise LabError(f"{host} is powered off")
        leader = h.leader_pid or procs.find_leader(net.NETNS_DIR / h.netns)
        return ["nsenter", "-t", str(leader), "-a", "--", "env", "-i", f"PATH={CONTAINER_PATH}", "HOME=/root",
                "LANG=C.UTF-8", f"TERM={os.environ.get('TERM', 'dumb')}", *cmd]

    def _nsenter(self, h: HostState, cmd: list[str], timeout: float = 10.0) -> subprocess.CompletedProcess:
        return subprocess.run(self.exec_argv(h.name, cmd), capture_output=True, text=True, timeout=timeout)

    def ssh_argv(self, host: str, cmd: list[str], connect_timeout: int = 5) -> list[str]:
        self._host(host)
        return ["ip", "netns", "exec", self.name, "ssh", "-F", str(self.dir / "ssh_config"),
                "-o", f"ConnectTimeout={connect_timeout}", host, "--", *cmd]

    def ssh(self, host: str, cmd: list[str], capture: bool = False, connect_timeout: int = 5,
            timeout: float | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(self.ssh_argv(host, cmd, connect_timeout), capture_output=capture, text=True,
                              timeout=timeout)

    def ansible_argv(self, args: list[str]) -> tuple[list[str], dict[str, str]]:
        """ansible-* run inside the lab's namespace with the lab's inventory first (a playbook's own
        `-i` adds to it) and SSH control sockets kept in the lab's directory (`down` ends them)."""
        if not args:
            raise LabError("give the program: ansible --name LAB -- ansible-playbook site.yml")
        self._require_state()
        prog = args[0]
        venv_bin = Path(sys.executable).parent / prog
        exe = str(venv_bin) if venv_bin.exists() else shutil.which(prog)
        if not exe:
            raise LabError(f"{prog} not found beside {sys.executable} nor on PATH (pip install -e '.[deploy]')")
        # By name, so a path (/venv/bin/ansible-playbook) gets the lab's inventory too.
        extra = ["-i", str(self.dir / "inventory.ini")] if Path(prog).name in ANSIBLE_PROGRAMS else []
        env = {**os.environ, "ANSIBLE_SSH_CONTROL_PATH_DIR": str(self.dir / "ansible-cp"),
               "ANSIBLE_PRIVATE_KEY_FILE": str(self.dir / "id_ed25519")}
        return ["ip", "netns", "exec", self.name, exe, *extra, *args[1:]], env

    # -- looking ------------------------------------------------------------------------
    def status(self) -> list[dict]:
        """One row per host: power, systemd's state, memory (PSS of the container's processes), disk."""
        self._require_state()
        rows = []
        for h in self.state.hosts.values():
            row = {"host": h.name, "ip": h.ip, "power": "on" if self._running(h) else "off",
                   "system": "-", "pss_mib": None, "processes": 0, "disk_mib": _du_mib(self.dir / "hosts" / h.name / "upper")}
            if row["power"] == "on":
                leader = h.leader_pid or procs.find_leader(net.NETNS_DIR / h.netns)
                try:
                    row["system"] = self._nsenter(h, ["systemctl", "is-system-running"], timeout=5).stdout.strip()
                except subprocess.TimeoutExpired:
                    row["system"] = "no answer"
                members = procs.pid_namespace_members(leader)
                row["processes"] = len(members)
                row["pss_mib"] = round(procs.pss_kib(members) / 1024, 1)
            rows.append(row)
        return rows

    def _host(self, host: str) -> HostState:
        self._require_state()
        if not HOST_RE.match(host) or host not in self.state.hosts:
            raise LabError(f"lab {self.name} has no host {host!r} (hosts: {' '.join(self.state.hosts)})")
        return self.state.hosts[host]

    def _require_state(self) -> None:
        if self.state is None:
            raise LabError(f"lab {self.name} is not up (no {self.dir}/state.json)")

    @staticmethod
    def _running(h: HostState) -> bool:
        return procs.alive(h.nspawn_pid)


def _du_mib(path: Path) -> float | None:
    if not path.exists():
        return None
    out = subprocess.run(["du", "-sxk", str(path)], capture_output=True, text=True).stdout.split()
    return round(int(out[0]) / 1024, 1) if out else None
