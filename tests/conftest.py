"""Shared fixtures: real etcd processes on loopback (no mocks)."""

from __future__ import annotations

import pytest

from rlfleet.tools.run.etcd_local import EtcdCluster


@pytest.fixture
def etcd():
    """A fresh single-member etcd for one test."""
    cluster = EtcdCluster(1).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def etcd3():
    """A fresh 3-member etcd cluster for one test."""
    cluster = EtcdCluster(3).start()
    yield cluster
    for m in cluster.members:  # members without quorum may ignore SIGTERM
        cluster.kill_member(m)
    cluster.stop()
