"""The lab: several real systemd hosts on one machine, for testing the cluster path.

Each host is a `systemd-nspawn --boot` container over a shared, cached Debian rootfs
(one overlay per host, so a host's disk survives a power-off), in its own network
namespace, on a bridge that lives in a namespace named after the lab. The controller
(Ansible, ssh, the tests) runs inside that namespace; nothing is addressed outside it.

    python -m rlfleet.tools.lab build        # cached rootfs (debootstrap), once
    python -m rlfleet.tools.lab wheelhouse   # wheels the hosts install from (no registry there)
    python -m rlfleet.tools.lab up --name lab --hosts 5
    python -m rlfleet.tools.lab down --name lab

Modules: `paths` (where things live, what the base holds), `rootfs` (build),
`wheelhouse`, `net` (namespaces, bridge, veth), `cgroups` (one per host), `procs` (finding
a host's processes, their memory), `hosts` (the `Lab`: boot, power-off, exec, status),
`files` (the state, ssh_config and inventory written for the controller), `commands`
(running the tools it calls, progress lines), `cli` (the command). docs/operations/lab.md has the recipe and the measured numbers.
"""

from rlfleet.tools.lab.hosts import Lab, LabError

__all__ = ["Lab", "LabError"]
