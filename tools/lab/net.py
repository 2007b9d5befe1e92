"""The lab's network: a bridge in the namespace named after the lab, one namespace per host.

    netns <lab>:        br0 <subnet>.254/24 (the controller side: ssh, Ansible, tests), vh<i> ports
    netns <lab>-h<i>:   eth0 <subnet>.<i>/24, default route via .254, lo

Everything is created inside namespaces (`ip -n`), so nothing of the lab appears in the
machine's own namespace and two labs may use the same subnet. The controller namespace
has no uplink: a host's default route ends there (it only makes `ansible_default_ipv4`
and "my address" look-ups give the cluster address).
"""

from __future__ import annotations

import re
from pathlib import Path

from rlfleet.tools.lab.commands import run

NETNS_DIR = Path("/run/netns")
BRIDGE = "br0"


def netns_exists(ns: str) -> bool:
    return (NETNS_DIR / ns).exists()


def ensure_bridge(ns: str, subnet: str) -> None:
    if not netns_exists(ns):
        run(["ip", "netns", "add", ns])
    run(["ip", "-n", ns, "link", "set", "lo", "up"])
    if run(["ip", "-n", ns, "link", "show", BRIDGE], check=False).returncode != 0:
        run(["ip", "-n", ns, "link", "add", BRIDGE, "type", "bridge"])
        run(["ip", "-n", ns, "addr", "add", f"{subnet}.254/24", "dev", BRIDGE])
    run(["ip", "-n", ns, "link", "set", BRIDGE, "up"])


def ensure_host_link(lab_ns: str, host_ns: str, port: str, ip: str, gateway: str) -> None:
    """The host's namespace with eth0 on the lab's bridge; kept across power-offs (like a cable)."""
    if not netns_exists(host_ns):
        run(["ip", "netns", "add", host_ns])
    run(["ip", "-n", host_ns, "link", "set", "lo", "up"])
    if run(["ip", "-n", host_ns, "link", "show", "eth0"], check=False).returncode != 0:
        # Made in the lab's namespace with its peer put straight into the host's: no name ever
        # exists in the machine's own namespace, where two labs would collide.
        run(["ip", "-n", lab_ns, "link", "del", port], check=False)
        run(["ip", "-n", lab_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", host_ns])
        run(["ip", "-n", host_ns, "addr", "add", f"{ip}/24", "dev", "eth0"])
    run(["ip", "-n", lab_ns, "link", "set", port, "master", BRIDGE, "up"])
    run(["ip", "-n", host_ns, "link", "set", "eth0", "up"])
    run(["ip", "-n", host_ns, "route", "replace", "default", "via", gateway])


def netns_pids(ns: str) -> list[int]:
    if not netns_exists(ns):
        return []
    out = run(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split()]


def delete_netns(ns: str) -> None:
    if netns_exists(ns):
        run(["ip", "netns", "del", ns], check=False)


def lab_namespaces(lab: str) -> list[str]:
    """The lab's namespaces that exist now: its own and every `<lab>-h<i>`."""
    if not NETNS_DIR.exists():
        return []
    own = re.compile(rf"^{re.escape(lab)}(-h[0-9]+)?$")
    return sorted(p.name for p in NETNS_DIR.iterdir() if own.match(p.name))
