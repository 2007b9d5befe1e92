"""The files a lab writes for its controller, in /var/lib/rlfleet-lab/<name>/.

    state.json      hosts, addresses, namespaces, nspawn and container PIDs (what `down` undoes)
    id_ed25519      the lab's SSH key (a copy of the one baked into the base)
    known_hosts     each host's own host keys, under its name and its address
    ssh_config      `ssh -F ssh_config h2` from inside the lab's namespace
    inventory.ini   an Ansible inventory skeleton: group `lab`, ansible_host per host, the key;
                    a playbook adds its own groups with a second `-i` (Ansible merges them)
    hosts/h<i>/     the host's overlay (upper = its disk, merged = its root) and console.log
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class HostState:
    name: str
    ip: str
    netns: str
    nspawn_pid: int = 0     # 0: powered off
    leader_pid: int = 0     # the container's PID 1 (systemd), as the machine sees it


@dataclass
class LabState:
    name: str
    subnet: str
    dir: str
    hosts: dict[str, HostState] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return Path(self.dir)

    @property
    def gateway(self) -> str:
        return f"{self.subnet}.254"

    def save(self) -> None:
        tmp = self.path / "state.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(tmp, self.path / "state.json")

    @classmethod
    def load(cls, lab_dir: Path) -> LabState | None:
        try:
            raw = json.loads((lab_dir / "state.json").read_text())
        except (OSError, ValueError):
            return None
        raw["hosts"] = {k: HostState(**v) for k, v in raw["hosts"].items()}
        return cls(**raw)


def etc_hosts(state: LabState) -> str:
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             f"{state.gateway}\tcontroller"]
    lines += [f"{h.ip}\t{h.name}" for h in state.hosts.values()]
    return "\n".join(lines) + "\n"


def ssh_config(state: LabState) -> str:
    d = state.path
    out = [f"# written by `python -m rlfleet.tools.lab up --name {state.name}`; use inside netns {state.name}:",
           f"#   ip netns exec {state.name} ssh -F {d / 'ssh_config'} h1", ""]
    for h in state.hosts.values():
        out += [f"Host {h.name}", f"  HostName {h.ip}", ""]
    out += ["Host *", "  User root", f"  IdentityFile {d / 'id_ed25519'}", "  IdentitiesOnly yes",
            f"  UserKnownHostsFile {d / 'known_hosts'}", "  StrictHostKeyChecking yes", "  BatchMode yes",
            "  ConnectTimeout 5", "  ControlMaster no", "  LogLevel ERROR", ""]
    return "\n".join(out)


def known_hosts(state: LabState, host_keys: dict[str, list[str]]) -> str:
    """host_keys: host name -> its public host keys ("ssh-ed25519 AAAA...")."""
    return "".join(f"{name},{state.hosts[name].ip} {key}\n" for name, keys in host_keys.items() for key in keys)


def inventory(state: LabState) -> str:
    d = state.path
    out = [f"# Ansible inventory skeleton of lab {state.name} (python -m rlfleet.tools.lab up).",
           "# Add your groups in a second inventory: ansible-playbook -i this -i yours site.yml", "[lab]"]
    out += [f"{h.name} ansible_host={h.ip}" for h in state.hosts.values()]
    out += ["", "[lab:vars]", "ansible_user=root", f"ansible_ssh_private_key_file={d / 'id_ed25519'}",
            f"ansible_ssh_common_args='-F {d / 'ssh_config'}'", "ansible_python_interpreter=/usr/bin/python3",
            f"lab_name={state.name}", f"lab_controller_ip={state.gateway}", ""]
    return "\n".join(out)
