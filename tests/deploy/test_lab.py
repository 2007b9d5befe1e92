"""The lab itself (tools/lab): hosts boot a real systemd, reach each other over TCP, keep their
disk across a power-off, and `down` leaves nothing behind. Prints the numbers docs/operations/lab.md reports."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rlfleet.tools.lab import cgroups, procs
from rlfleet.tools.lab.paths import ROOTFS_STAMP, lab_dir
from tests.deploy.conftest import lab_cli
from tests.integration.helpers import wait_for

pytestmark = pytest.mark.lab


def _assert_gone(name: str, leaders: list[int]) -> None:
    netns = sorted(p.name for p in Path("/run/netns").glob(f"{name}*"))
    assert netns == [], "network namespaces left behind"
    assert not [line for line in Path("/proc/mounts").read_text().splitlines() if f"{lab_dir(name)}/" in line], \
        "mounts left behind"
    assert procs.nspawn_pids_under(lab_dir(name)) == [], "systemd-nspawn processes left behind"
    assert not [p for p in leaders if procs.alive(p)], "container processes left behind"
    assert cgroups.leftovers(name) == [] and cgroups.procs_in(name) == [], "cgroups left behind"
    assert not lab_dir(name).exists()


def test_build_is_cached(capsys):
    t0 = time.monotonic()
    out = lab_cli("build").stdout
    took = time.monotonic() - t0
    stamp = json.loads(ROOTFS_STAMP.read_text())
    assert "cached" in out
    with capsys.disabled():
        print(f"\n[lab numbers] rootfs build: cold {stamp['build_s']:.0f} s ({stamp['size_mb']} MB), "
              f"cached {took:.1f} s")


def test_two_hosts_network_power_and_teardown(lab_factory):
    lab = lab_factory("rlt2", 2, subnet="10.211.0")
    status = lab.status()
    assert {h: r["system"] for h, r in status.items()} == {"h1": "running", "h2": "running"}

    # ssh from the controller's namespace, and each host is its own machine
    assert lab.ssh("h1", "hostname").stdout.strip() == "h1"
    ids = {h: lab.exec(h, "cat", "/etc/machine-id").stdout.strip() for h in ("h1", "h2")}
    assert len(set(ids.values())) == 2 and all(len(i) == 32 for i in ids.values())
    host_keys = {h: lab.exec(h, "cat", "/etc/ssh/ssh_host_ed25519_key.pub").stdout.split()[1] for h in ("h1", "h2")}
    assert host_keys["h1"] != host_keys["h2"]
    assert lab.exec("h1", "test", "-f", "/srv/wheelhouse/" + _rlfleet_wheel(), check=False).returncode == 0

    # h1 reaches h2 over TCP: a web server on h2 (a transient unit of h2's systemd), curl from h1
    lab.exec("h2", "sh", "-c", "mkdir -p /srv/www && cat /etc/machine-id > /srv/www/id")
    lab.exec("h2", "systemd-run", "--unit=web", "--working-directory=/srv/www",
             "python3", "-m", "http.server", "8000", "--bind", "10.211.0.2")
    served = wait_for("h2's web server from h1", lambda: lab.ssh(
        "h1", "curl", "-sf", "--max-time", "3", "http://h2:8000/id", check=False).stdout.strip(), every_s=0.5)
    assert served == ids["h2"]

    # power-off keeps the disk: a file written before is there after `start`
    lab.ssh("h2", "echo before-poweroff > /root/marker")
    assert lab.status()["h2"]["power"] == "on"
    lab.cli("poweroff", "h2")
    assert lab.status()["h2"]["power"] == "off"
    assert lab.ssh("h2", "true", check=False).returncode != 0
    assert lab.ssh("h1", "curl", "-sf", "--max-time", "2", "http://h2:8000/id", check=False).returncode != 0
    lab.cli("start", "h2")
    assert lab.status()["h2"]["system"] == "running"
    assert lab.ssh("h2", "cat /root/marker /etc/machine-id").stdout.split() == ["before-poweroff", ids["h2"]]

    # a running lab gains a host (a machine added to a live job): reachable by name from the
    # controller and from the hosts that were already up, and in the inventory
    assert "h3 up in" in lab.cli("add-host").stdout
    assert lab.status()["h3"]["system"] == "running"
    assert lab.ssh("h3", "hostname").stdout.strip() == "h3"
    assert lab.ssh("h1", "getent", "hosts", "h3").stdout.split()[0] == "10.211.0.3"
    assert "h3 ansible_host=10.211.0.3" in (lab_dir(lab.name) / "inventory.ini").read_text()

    # down leaves no namespace, mount or process behind, and a second down is a no-op
    state = json.loads((lab_dir(lab.name) / "state.json").read_text())
    leaders = [h["leader_pid"] for h in state["hosts"].values()]
    assert all(procs.alive(p) for p in leaders)
    lab.cli("down")
    _assert_gone(lab.name, leaders)
    assert "nothing left behind" in lab.cli("down").stdout


def test_down_after_a_crashed_up(lab_factory):
    """An `up` killed half-way (here: its hosts started, state on disk) is cleaned up by `down`."""
    lab = lab_factory("rltc", 1, subnet="10.212.0")
    state = json.loads((lab_dir(lab.name) / "state.json").read_text())
    (lab_dir(lab.name) / "state.json").unlink()  # as if `up` died before writing its state
    lab.cli("down")
    _assert_gone(lab.name, [h["leader_pid"] for h in state["hosts"].values()])


def test_five_hosts_up_time_and_memory(lab_factory, capsys):
    lab = lab_factory("rlt5", 5, subnet="10.213.0")
    status = lab.status()
    assert all(r["system"] == "running" for r in status.values()), status
    # every host reaches every other by name (the /etc/hosts `up` writes)
    assert lab.ssh("h1", "for h in h2 h3 h4 h5; do ping -c1 -W2 $h >/dev/null || exit 1; done").returncode == 0
    pss = [r["pss_mib"] for r in status.values()]
    t0 = time.monotonic()
    lab.cli("down")
    down_s = time.monotonic() - t0
    with capsys.disabled():
        print(f"\n[lab numbers] up 5 hosts: {lab.up_s:.1f} s; down: {down_s:.1f} s; memory per host (PSS): "
              f"mean {sum(pss) / len(pss):.1f} MiB, max {max(pss):.1f} MiB; "
              f"processes per host {[r['processes'] for r in status.values()]}")


def _rlfleet_wheel() -> str:
    from rlfleet.tools.lab.paths import WHEELHOUSE
    wheels = sorted(p.name for p in WHEELHOUSE.glob("rlfleet-*.whl"))
    assert wheels, f"no rlfleet wheel in {WHEELHOUSE}: run `python -m rlfleet.tools.lab wheelhouse`"
    return wheels[0]
