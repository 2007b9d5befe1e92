"""The remote_http reward backend against real reference endpoints
(tools/reward_endpoint.py, real subprocesses on real ports) that inject latency,
errors and hangs; plus its pure parts (backoff, circuit breaker) in process."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest

from rlfleet.common.secret_files import write_private
from rlfleet.daemons.reward_host.remote.backend import RemoteBackend
from rlfleet.daemons.reward_host.remote.config import RemoteHttpConfig, RetryConfig
from rlfleet.daemons.reward_host.remote.policy import Breaker, backoff_s
from rlfleet.daemons.reward_host.workers import RewardJob, RewardOutcome
from rlfleet.daemons.tasks import get_task
from tests.integration.helpers import wait_for

TASK = get_task("arithmetic")
PROMPTS = TASK.make_prompts("train", 64, seed=11)


class Endpoint:
    """A reference endpoint process; ``url`` is its /score."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "rlfleet.tools.reward_endpoint", *args],
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("listening on "), line
        self.url = line.split()[-1]
        self.base = self.url.rsplit("/", 1)[0]

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.base}/_stats", timeout=10) as r:
            return json.loads(r.read())

    def control(self, **knobs: Any) -> None:
        req = urllib.request.Request(f"{self.base}/_control", data=json.dumps(knobs).encode(),
                                     method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read()) == {"ok": True}

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def endpoints():
    started: list[Endpoint] = []

    def start(*args: str) -> Endpoint:
        started.append(Endpoint(*args))
        return started[-1]

    yield start
    for e in started:
        e.close()


def job(i: int, right: bool = True, key: str | None = None) -> RewardJob:
    p = PROMPTS[i]
    return RewardJob(key or f"p{i}", "arithmetic", {}, p, [p.answer if right else "x"])


def expected(i: int, right: bool = True) -> float:
    return TASK.reward(PROMPTS[i], [PROMPTS[i].answer if right else "x"])


def collect(backend: RemoteBackend, n: int, timeout_s: float = 30.0) -> list[RewardOutcome]:
    out: list[RewardOutcome] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"{len(out)} of {n} outcomes within {timeout_s} s: {out}"
        out += backend.poll(left)
    assert len(out) == n, f"more outcomes than jobs: {out}"  # one outcome per submit
    return out


# ----------------------------------------------------------------------------- pure parts
def test_full_jitter_backoff_stays_under_a_doubling_cap():
    retry = RetryConfig(backoff_base_s=0.1, backoff_max_s=1.0)
    rng = random.Random(3)
    for attempt, cap in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (9, 1.0)]:
        draws = [backoff_s(attempt, retry, rng) for _ in range(300)]
        assert 0 <= min(draws) and max(draws) <= cap
        assert max(draws) > 0.8 * cap and min(draws) < 0.2 * cap  # spread over [0, cap]
    none = RetryConfig(backoff_base_s=0.1, backoff_max_s=1.0, jitter="none")
    assert [backoff_s(a, none, rng) for a in (1, 2, 3)] == [0.1, 0.2, 0.4]
    # Retry-After is a floor, capped at backoff_max_s.
    assert backoff_s(1, none, rng, retry_after_s=0.5) == 0.5
    assert backoff_s(1, none, rng, retry_after_s=3600) == 1.0


def test_breaker_opens_after_consecutive_failures_and_half_opens():
    b = Breaker(failures=3, open_s=10.0, probes=1)
    b.failure(0.0)
    b.failure(1.0)
    b.success()  # not consecutive: the count starts again
    b.failure(2.0)
    b.failure(3.0)
    assert b.allows(3.0, 0) and b.state == "closed"
    b.failure(4.0)
    assert b.state == "open" and not b.allows(13.9, 0)
    assert b.allows(14.0, 0) and b.state == "half_open"
    assert not b.allows(14.0, 1)  # one probe at a time
    b.failure(15.0)  # the probe failed: open for another open_s
    assert b.state == "open" and not b.allows(24.9, 0) and b.allows(25.0, 0)
    b.success()
    assert b.state == "closed" and b.allows(25.0, 5)


# ----------------------------------------------------------------------------- real endpoints
def test_scores_and_respects_the_per_endpoint_concurrency_limit(endpoints, backends):
    e = endpoints("--latency-s", "0.1")
    b = backends(endpoints=[e.url], max_concurrency=3)
    for i in range(24):
        b.submit(job(i, right=i % 2 == 0))
    out = collect(b, 24)
    assert {o.key: (o.reward, o.error) for o in out} == {
        f"p{i}": (expected(i, i % 2 == 0), "") for i in range(24)}
    s = e.stats()
    assert s["max_in_flight"] == 3 and s["requests"] == 24  # never above, and it was used


def test_a_hung_attempt_times_out_and_the_retry_succeeds(endpoints, backends):
    e = endpoints()
    e.control(hang_next=1)
    b = backends(endpoints=e.url, timeout_s=1.0, total_timeout_s=20,
                 retry={"backoff_base_s": 0.05, "backoff_max_s": 0.05})
    b.submit(job(0))
    [o] = collect(b, 1)
    assert (o.key, o.reward, o.error) == ("p0", expected(0), "")
    assert o.seconds >= 1.0
    s = e.stats()
    assert (s["hangs"], s["requests"], s["scorings"]) == (1, 2, {"p0": 1})


def test_5xx_is_retried_with_backoff_then_succeeds(endpoints, backends):
    e = endpoints()
    e.control(fail_next=2, error_status=503)
    b = backends(endpoints=e.url, retry={"max_attempts": 3, "backoff_base_s": 0.2,
                                         "backoff_max_s": 5, "jitter": "none"})
    b.submit(job(1))
    [o] = collect(b, 1)
    assert (o.reward, o.error) == (expected(1), "")
    assert o.seconds >= 0.2 + 0.4  # two backoffs, doubling
    assert e.stats()["requests"] == 3


def test_attempts_run_out_into_an_outcome_with_the_last_error(endpoints, backends):
    e = endpoints("--error-rate", "1", "--error-status", "502")
    b = backends(endpoints=e.url, retry={"max_attempts": 3, "backoff_base_s": 0.01},
                 breaker={"failures": 100})
    b.submit(job(2))
    [o] = collect(b, 1)
    assert o.reward == 0.0
    assert o.error == f"3 attempts failed; last: {e.url}: HTTP 502: injected failure"
    assert e.stats()["requests"] == 3


def test_4xx_is_final_not_retried(endpoints, backends, tmp_path):
    secret = tmp_path / "token"
    write_private(secret, b"Bearer s3cret\n")
    e = endpoints("--auth-file", str(secret))
    without = backends(endpoints=e.url)
    without.submit(job(3))
    [o] = collect(without, 1)
    assert o.error == f"{e.url}: HTTP 401: wrong or missing Authorization header"
    # A reward that raises at the endpoint is a 422: the job's answer, not the endpoint's fault.
    bad_task = RewardJob("p4", "arithmetic", {"digits": "many"}, PROMPTS[4], ["1"])
    with_auth = backends(endpoints=e.url, auth_secret_file=str(secret))
    with_auth.submit(bad_task)
    with_auth.submit(job(5))
    got = {o.key: o for o in collect(with_auth, 2)}
    assert got["p4"].error.startswith(f"{e.url}: HTTP 422: ") and got["p4"].reward == 0.0
    assert (got["p5"].reward, got["p5"].error) == (expected(5), "")
    assert e.stats()["requests"] == 3  # one each: nothing retried
    assert with_auth.stats()[0]["state"] == "closed"


def test_the_circuit_opens_after_n_failures_and_a_half_open_probe_closes_it(endpoints, backends):
    e = endpoints("--error-rate", "1")
    b = backends(endpoints=e.url, total_timeout_s=30,
                 retry={"max_attempts": 1}, breaker={"failures": 3, "open_s": 1.5})
    for i in range(3):
        b.submit(job(i))
        [o] = collect(b, 1)
        assert o.error.startswith("1 attempts failed; last:")
    assert b.stats()[0]["state"] == "open" and e.stats()["requests"] == 3
    e.control(error_rate=0.0)  # the endpoint recovers; the breaker cannot know yet
    opened = time.monotonic()
    for i in range(3, 6):
        b.submit(job(i))
    # Nothing is sent while open; then one probe, and once it succeeds, the rest.
    assert b.poll(0.5) == [] and e.stats()["requests"] == 3
    out = collect(b, 3)
    assert time.monotonic() - opened >= 1.0
    assert {(o.key, o.error) for o in out} == {(f"p{i}", "") for i in range(3, 6)}
    assert b.stats()[0]["state"] == "closed" and e.stats()["requests"] == 6


def test_a_hung_endpoint_blocks_neither_the_others_nor_the_owner(endpoints, backends):
    hung = endpoints("--hang-rate", "1")
    ok = endpoints()
    b = backends(endpoints=[hung.url, ok.url], timeout_s=5.0, total_timeout_s=30,
                 retry={"backoff_base_s": 0.01}, breaker={"failures": 2, "open_s": 60})
    for i in range(10):
        b.submit(job(i))
    first = b.poll(30)
    # The first outcomes came before any hung attempt timed out (the hung endpoint has no
    # failure yet): the healthy endpoint did not wait for them.
    assert first and b.stats()[0]["failures"] == 0, ("the healthy endpoint waited for the hung one", b.stats())
    out = first + collect(b, 10 - len(first), timeout_s=30)
    assert {(o.key, o.reward, o.error) for o in out} == {(f"p{i}", expected(i), "") for i in range(10)}
    assert hung.stats()["hangs"] >= 1
    assert b.stats()[0]["state"] == "open"  # two timeouts: the hung endpoint is avoided


def test_kill9_of_an_endpoint_mid_request_retries_on_another(endpoints, backends):
    slow = endpoints("--latency-s", "30")
    fast = endpoints()
    b = backends(endpoints=[slow.url, fast.url], max_concurrency=4, timeout_s=60,
                 total_timeout_s=120, retry={"backoff_base_s": 0.05})
    for i in range(8):
        b.submit(job(i))
    wait_for("requests held by the slow endpoint", lambda: slow.stats()["in_flight"] == 4,
             timeout_s=30)
    slow.kill9()
    out = collect(b, 8, timeout_s=30)
    assert {(o.key, o.reward, o.error) for o in out} == {(f"p{i}", expected(i), "") for i in range(8)}
    assert sum(fast.stats()["scorings"].values()) == 8


def test_kill9_of_the_only_endpoint_ends_jobs_as_errors_none_lost(endpoints, backends):
    e = endpoints("--latency-s", "30")
    b = backends(endpoints=e.url, timeout_s=60, total_timeout_s=120,
                 retry={"max_attempts": 3, "backoff_base_s": 0.05}, breaker={"failures": 100})
    for i in range(5):
        b.submit(job(i))
    wait_for("requests held by the endpoint", lambda: e.stats()["in_flight"] == 5, timeout_s=30)
    e.kill9()
    out = collect(b, 5, timeout_s=30)
    assert sorted(o.key for o in out) == [f"p{i}" for i in range(5)]
    for o in out:
        assert o.reward == 0.0 and o.error.startswith("3 attempts failed; last: "), o.error


def test_a_trajectory_id_is_scored_once(endpoints, backends):
    e = endpoints("--latency-s", "0.3")
    b = backends(endpoints=e.url)
    b.submit(job(7))
    b.submit(job(7))  # a copy while the first is in flight: the same request
    out = collect(b, 2)
    assert [(o.key, o.reward, o.error) for o in out] == [("p7", expected(7), "")] * 2
    assert e.stats()["requests"] == 1
    # A restarted reward-host (a new backend) asks again: the endpoint answers from its
    # idempotency record, without scoring again.
    again = backends(endpoints=e.url)
    again.submit(job(7))
    [o] = collect(again, 1)
    assert (o.reward, o.error) == (expected(7), "")
    s = e.stats()
    assert s["requests"] == 2 and s["scorings"] == {"p7": 1}


def test_a_lowered_limit_applies_to_new_requests(endpoints, backends):
    e = endpoints("--latency-s", "0.1")
    b = backends(endpoints=e.url, max_concurrency=8)
    b.set_max_concurrency(2)
    for i in range(10):
        b.submit(job(i))
    assert len(collect(b, 10)) == 10
    assert e.stats()["max_in_flight"] == 2 and b.stats()[0]["limit"] == 2


def test_a_pipeline_plan_resizes_the_limit_over_all_endpoints(endpoints, backends):
    """As a pipeline stage: 5 workers planned over 2 endpoints is 3 at once on each."""
    e1, e2 = endpoints("--latency-s", "0.1"), endpoints("--latency-s", "0.1")
    b = backends(endpoints=[e1.url, e2.url], max_concurrency=8)
    b.resize(5)
    for i in range(24):
        b.submit(job(i))
    assert len(collect(b, 24)) == 24
    assert [s["limit"] for s in b.stats()] == [3, 3]
    assert max(e1.stats()["max_in_flight"], e2.stats()["max_in_flight"]) <= 3


def test_a_missing_secret_file_fails_at_start_with_its_path(tmp_path):
    path = tmp_path / "nope"
    with pytest.raises(ValueError, match=f"auth_secret_file {path}: cannot open"):
        RemoteBackend(RemoteHttpConfig(endpoints="http://127.0.0.1:9/score",
                                       auth_secret_file=str(path)))


def test_a_secret_file_others_can_read_is_refused_at_start(tmp_path):
    path = tmp_path / "token"
    path.write_text("Bearer s3cret\n")
    path.chmod(0o640)
    with pytest.raises(ValueError, match=f"mode 0640 lets group or others read it.*chmod 600 {path}"):
        RemoteBackend(RemoteHttpConfig(endpoints="http://127.0.0.1:9/score",
                                       auth_secret_file=str(path)))


def test_jobs_start_in_the_dispatch_order(endpoints):
    """[reward_host.dispatch] orders the queue; its "workers" are endpoints with a free slot."""
    from rlfleet.daemons.reward_host.dispatch import EbfDispatch

    e = endpoints("--latency-s", "0.5")  # p0 holds the slot while the rest are queued
    order = {f"p{i}": float(-i) for i in range(6)}  # the last submitted is the most urgent
    b = RemoteBackend(RemoteHttpConfig(endpoints=e.url, max_concurrency=1),
                      dispatch=EbfDispatch(lambda j: order[j.key]))
    try:
        for i in range(6):
            b.submit(job(i))
        out = collect(b, 6)
    finally:
        b.close()
    # p0 went out at once (the only job then); the rest by priority, one slot at a time.
    assert [o.key for o in out] == ["p0", "p5", "p4", "p3", "p2", "p1"]
