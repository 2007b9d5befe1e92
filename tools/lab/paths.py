"""Where the lab keeps things, and what the base rootfs holds.

The cache (/var/cache/rlfleet-lab) is shared by every lab: the base rootfs, the
wheelhouse and the SSH key baked into the base. Each lab has its own directory under
/var/lib/rlfleet-lab/<name>/ with the hosts' overlays (their disks) and the files the
controller uses (state.json, ssh_config, known_hosts, inventory.ini). It is on disk,
not in /run, because a host's disk must outlive a power-off and a `start`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

CACHE = Path(os.environ.get("RLFLEET_LAB_CACHE", "/var/cache/rlfleet-lab"))
ROOTFS = CACHE / "rootfs"
ROOTFS_STAMP = CACHE / "rootfs.stamp.json"
WHEELHOUSE = CACHE / "wheelhouse"
WHEELHOUSE_STAMP = CACHE / "wheelhouse.stamp.json"
KEY = CACHE / "ssh" / "id_ed25519"          # its .pub is in the base's /root/.ssh/authorized_keys
LABS = Path(os.environ.get("RLFLEET_LAB_ROOT", "/var/lib/rlfleet-lab"))

SUITE = "bookworm"
# On the controller: nspawn, debootstrap, ssh.
CONTROLLER_PACKAGES = ("systemd-container", "debootstrap", "openssh-client")
# Baked into the base: the hosts have no registry access, so everything a role needs is here.
# python3-apt and python3-cryptography are for Ansible modules (apt facts, openssl_*);
# acl: Ansible's become_user to an unprivileged user (rlfleet, etcd) shares its temp files by
# setfacl; rsync for `synchronize`; netbase gives /etc/services and /etc/protocols; ping for people.
BASE_PACKAGES = (
    "systemd", "systemd-sysv", "dbus", "python3", "python3-venv", "python3-apt",
    "python3-cryptography", "openssh-server", "etcd-server", "etcd-client", "prometheus",
    "iproute2", "iputils-ping", "procps", "sudo", "ca-certificates", "curl", "openssl",
    "netbase", "less", "acl", "rsync",
)
# Debian starts these on install; in the base they stay off so a bare host runs no default
# etcd or Prometheus: Ansible enables what it configures. apt's timers only add noise.
BASE_DISABLED_UNITS = (
    "etcd.service", "prometheus.service", "prometheus-node-exporter.service",
    "apt-daily.timer", "apt-daily-upgrade.timer",
)

NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,11}$")  # netns "<name>-h<i>" stays short and readable
HOST_RE = re.compile(r"^h[1-9][0-9]?$")


def lab_dir(name: str) -> Path:
    return LABS / name


def host_netns(name: str, host: str) -> str:
    return f"{name}-{host}"


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise ValueError(f"lab name must match {NAME_RE.pattern} (it names network namespaces), got {name!r}")
    return name
