"""The lab's pure parts (tools/lab): names, the files written for the controller, the wheel list.
The lab itself (root, nspawn) is tested in tests/deploy by `make test-deploy`."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.tools.lab import wheelhouse
from rlfleet.tools.lab.files import HostState, LabState, etc_hosts, inventory, known_hosts, ssh_config
from rlfleet.tools.lab.paths import check_name

REPO = Path(__file__).resolve().parents[3]


def _state() -> LabState:
    hosts = {f"h{i}": HostState(f"h{i}", f"10.9.0.{i}", f"t-h{i}") for i in (1, 2)}
    return LabState("t", "10.9.0", "/var/lib/rlfleet-lab/t", hosts)


@pytest.mark.parametrize("bad", ["", "Lab", "1lab", "a" * 13, "la b", "lab/x"])
def test_lab_names_that_cannot_name_a_namespace_are_refused(bad):
    with pytest.raises(ValueError, match="lab name"):
        check_name(bad)
    assert check_name("ci-5") == "ci-5"


def test_inventory_and_ssh_config_point_at_the_lab_key_and_host_keys():
    st = _state()
    inv = inventory(st)
    assert "h1 ansible_host=10.9.0.1\nh2 ansible_host=10.9.0.2\n" in inv
    assert "ansible_ssh_private_key_file=/var/lib/rlfleet-lab/t/id_ed25519" in inv
    assert "ansible_ssh_common_args='-F /var/lib/rlfleet-lab/t/ssh_config'" in inv
    cfg = ssh_config(st)
    assert "Host h2\n  HostName 10.9.0.2" in cfg and "StrictHostKeyChecking yes" in cfg
    assert cfg.index("Host h1") < cfg.index("Host *")  # ssh takes the first value it finds
    assert known_hosts(st, {"h1": ["ssh-ed25519 AAAA"]}) == "h1,10.9.0.1 ssh-ed25519 AAAA\n"
    assert "10.9.0.254\tcontroller" in etc_hosts(st) and "10.9.0.2\th2" in etc_hosts(st)


def test_the_wheelhouse_takes_every_pin_of_the_ml_extra():
    reqs = wheelhouse.requirements(REPO)
    assert "torch==2.13.0" in reqs and all("==" in r for r in reqs)
