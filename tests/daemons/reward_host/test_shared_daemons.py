"""Two jobs share one reward service, for real: the service (`rlfleet reward-service`, a
rule stage and a simulated accelerator stage) as a subprocess, and two real reward-host
daemons of two jobs (their own names, their own fake trainers, one etcd) pointing their
remote_http backends at it. The service is killed -9 mid-request and restarted on its
port: the reward-hosts' retries deliver every trajectory of both jobs to its own
trainer, once per id after dedup, with the right reward."""

from __future__ import annotations

import threading

import pytest

from rlfleet.daemons.tasks import get_task
from tests.integration.helpers import wait_for

from .fakes import FakeTrainer, trajectory
from .harness import RewardHostHarness
from .test_shared_service import SharedService

TASK = get_task("arithmetic")
JOBS = ("shared-a", "shared-b")
PROMPTS_PER_JOB = 40

JOB_SPEC = """group_size = 2

[trainer]
batch_size = 8

[reward_host.backend]
kind = "remote_http"
endpoints = ["{url}"]
max_concurrency = 8
timeout_s = 10
total_timeout_s = 120

[reward_host.backend.retry]
max_attempts = 200
backoff_base_s = 0.05
backoff_max_s = 0.5

[reward_host.backend.breaker]
failures = 3
open_s = 0.5
"""


@pytest.fixture
def trainers():
    made = {job: FakeTrainer() for job in JOBS}
    yield made
    for t in made.values():
        t.close()


def test_two_jobs_share_one_service_through_a_kill9_of_it(tmp_path, etcd, trainers):
    svc = SharedService(tmp_path, judge_s=0.05)
    hosts, trajs, prompts = {}, {}, {}
    for n, job in enumerate(JOBS):
        folder = tmp_path / job
        folder.mkdir()
        hosts[job] = RewardHostHarness(folder, etcd, trainers[job], job, JOB_SPEC.format(url=svc.url))
        # Other prompts per job under the same trajectory ids: a mix-up shows as a wrong reward.
        prompts[job] = TASK.make_prompts("train", PROMPTS_PER_JOB, seed=5 + n)
        trajs[job] = [trajectory(p, i, k, p.answer if (i + k + n) % 3 else "7")
                      for i, p in enumerate(prompts[job]) for k in range(2)]
    halfway = threading.Event()  # the second halves once the service has been restarted
    try:
        for job in JOBS:
            hosts[job].start()
        feeders = [hosts[job].feed(trajs[job], halfway) for job in JOBS]

        def both_in_flight() -> bool:
            tenants = svc.stats()["tenants"]
            return svc.stats()["pending"] >= 2 and all(tenants.get(j, {}).get("requests") for j in JOBS)

        wait_for("both jobs' requests in the service", both_in_flight, timeout_s=60, every_s=0.01)
        svc.kill9()  # mid-request: its queues, running requests and answers are gone
        assert sum(h.n_acked() for h in hosts.values()) < 2 * len(trajs[JOBS[0]]), "nothing left to test"
        svc.start()  # the same port: the reward-hosts' retries find it again
        halfway.set()
        for job in JOBS:
            wait_for(f"{job}: every trajectory acked",
                     lambda job=job: hosts[job].n_acked() == len(trajs[job]), timeout_s=120)
        for feeder in feeders:
            feeder.join(10)

        for job in JOBS:
            got = trainers[job].unique()
            assert set(got) == {t.trajectory_id for t in trajs[job]}  # none lost, none of the other job's
            for t in trajs[job]:
                s = got[t.trajectory_id]
                expected = TASK.reward(prompts[job][t.prompt_id], [t.turns[0].action])
                assert s.reward == expected and s.reward_error == "" and s.trajectory == t, t.trajectory_id
            # Re-sent copies (lost acks, the retries) carry the same reward: none counted twice
            # after the trainer's dedup by id.
            for copy in trainers[job].copies:
                assert copy.reward == got[copy.trajectory.trajectory_id].reward
        # The restarted service's planner had both tenants' batches: it closed them into its
        # history and planned with each tenant's open batches.
        stats = svc.stats()
        for job in JOBS:
            tenant = stats["tenants"][job]
            assert tenant["requests"]["scored"] > 0 and tenant["batches"] >= 1, (job, stats)
            assert tenant["plans"] >= 1, (job, stats)
        assert stats["pending"] == 0 and set(stats["stages"]) == {"check", "judge"}
    finally:
        try:
            for h in hosts.values():
                h.close()
        finally:
            summary = svc.close()
    assert summary.startswith("reward service stopped: shared-a:")
