"""Shared fixtures: real etcd processes on loopback (no mocks); the suite's split over workers."""

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


# `make test` runs the suite on two pytest-xdist workers with `--dist loadgroup`. Each module is
# one group (its module fixtures are built once, its tests run in file order), except the
# modules that run a fleet (`rlfleet run`, or the daemons of a job as real processes):
# CPU-bound, with deadlines set for one fleet on the two cores, they share the group "fleet"
# and run one at a time, while the rest of the suite runs on the other worker. Without xdist
# the marks do nothing.
FLEET_MODULES = {f"tests/{m}.py" for m in (
    "e2e/test_kill_each_role", "security/test_curve", "security/test_secure_run",
    "fuzz/test_trainer", "fuzz/test_reward_host", "fuzz/test_rollout",
    "daemons/trainer/test_daemon", "daemons/trainer/test_restart", "daemons/trainer/test_handover",
    "integration/test_affinity_sim", "integration/test_agent", "integration/test_agentic_faults",
    "integration/test_etcd_maintenance", "integration/test_filtering_sim", "integration/test_gpu_placement",
    "integration/test_lifecycle",
    "integration/test_live_nodes", "integration/test_liveness", "integration/test_longtail_sim",
    "integration/test_pause", "integration/test_reward_pipeline", "integration/test_run_outcomes",
    "integration/test_run_ownership", "integration/test_stop", "integration/test_switchover",
    "integration/test_trainer_disk_full", "tools/bench/test_gpu_check",
    "integration/test_vllm_fleet",
    # several ranks of the megatron learner as processes (torchrun), and the relay daemons
    # (a CI run saw their leases expire while the megatron ranks ran beside them)
    "daemons/trainer/test_megatron_parallel", "tools/bench/test_scale", "relay/test_transports")}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        group = "fleet" if module in FLEET_MODULES else module
        item.add_marker(pytest.mark.xdist_group(group))
