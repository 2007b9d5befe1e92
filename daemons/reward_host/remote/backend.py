"""The ``remote_http`` reward backend: trajectories scored by HTTP endpoints
("serverless" reward functions, RollArt §5.2), behind the RewardBackend seam.

Threads:
- the owner's (the reward service's one thread): ``submit``, ``poll``, ``fds``;
- ``reward-remote``: an asyncio loop running every request with one httpx2 AsyncClient.
  Everything below the owner's API (the queue, the endpoints' counters and circuit
  breakers, the retry timers) lives in this thread only, so none of it needs a lock.
  Outcomes cross back through a deque under a lock, announced on a pipe whose read
  end is ``fds()``: the service's one zmq.Poller covers sockets and endpoints alike.

The protocol (docs/design/reward.md, "Remote endpoints"): one POST per attempt to the
endpoint's URL with the JSON body ``{"trajectory_id", "task", "task_kwargs", "prompt",
"completions", "tenant", "batch", "batch_requests"}`` (the last three for a shared reward
service, shared_service.py; other endpoints ignore them) and the header ``Idempotency-Key: <trajectory id>`` (plus
``X-Rlfleet-Attempt`` and the optional auth header); the answer ``200 {"reward": <finite
number>, "info": {...}}``. An endpoint must answer a repeated key with the result it
gave, without scoring again: a retry after a lost answer, or the same trajectory
re-sent by an env-host to a restarted reward-host, then costs one scoring. An
``https://`` endpoint's certificate is checked against ``ca_file`` (remote_config.py,
which also refuses a token over plain http:// to a host that is not loopback).

Failures, per attempt: a connect error, a broken connection, a timeout, 408, 429 or a
5xx is retried (with full-jitter exponential backoff, ``Retry-After`` honoured up to
the backoff cap, preferably on another endpoint) and counts against the endpoint's
circuit breaker; any other status is the job's final answer (a 4xx will not change
on a retry) and a 200 that is not the protocol counts against the breaker but is not
retried. A job whose attempts or ``total_timeout_s`` run out comes back as an outcome
with ``error`` set; nothing is raised into the service and no job is lost.

The decisions without I/O (the body, reading answers, backoff, the circuit breaker,
and why they are our own code) are in remote_policy.py.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import random
import select
import ssl
import threading
import time
from typing import Any

import httpx2
from prometheus_client import Counter, Gauge

from rlfleet.daemons.reward_host.backends import RewardBackend
from rlfleet.daemons.reward_host.dispatch import Dispatch, FifoDispatch
from rlfleet.daemons.reward_host.remote.config import RemoteHttpConfig, read_secret
from rlfleet.daemons.reward_host.remote.policy import (
    Breaker,
    backoff_s,
    error_text,
    job_body,
    read_reward,
    retry_after,
    retryable,
)
from rlfleet.daemons.reward_host.workers import RewardJob, RewardOutcome

log = logging.getLogger("rlfleet.reward_host")

_ERROR_CHARS = 500
ATTEMPTS = Counter("rlfleet_reward_remote_attempts_total", "Requests to remote reward endpoints",
                   ["endpoint", "result"])  # result: ok, retry, final
CIRCUIT_OPEN = Gauge("rlfleet_reward_remote_circuit_open",
                     "1 while an endpoint's circuit is open or half-open", ["endpoint"])


# ----------------------------------------------------------------------------- state
class Endpoint:
    def __init__(self, url: str, limit: int, breaker: Breaker) -> None:
        self.url, self.limit, self.breaker = url, limit, breaker
        self.in_flight = 0
        self.probes_in_flight = 0
        self.requests = 0
        self.failures = 0

    def available(self, now: float) -> bool:
        return self.in_flight < self.limit and self.breaker.allows(now, self.probes_in_flight)

    def snapshot(self) -> dict[str, Any]:
        return {"url": self.url, "state": self.breaker.state, "in_flight": self.in_flight,
                "limit": self.limit, "requests": self.requests, "failures": self.failures}


class _Job:
    """A job's progress: queued (in the dispatch), running, backoff (a timer), retry
    (waiting for a slot, ahead of the dispatch); ``waiters``: submits sharing it."""

    def __init__(self, job: RewardJob, now: float, deadline: float, body: bytes) -> None:
        self.job, self.submitted, self.deadline = job, now, deadline
        self.body = body
        self.phase = "queued"
        self.waiters = 1
        self.attempts = 0
        self.tried: list[int] = []
        self.last_error = ""
        self.timer: asyncio.TimerHandle | None = None


class _Retry(Exception):
    def __init__(self, error: str, after_s: float = 0.0) -> None:
        super().__init__(error)
        self.error, self.after_s = error, after_s


class _Final(Exception):
    def __init__(self, error: str, endpoint_failed: bool) -> None:
        super().__init__(error)
        self.error, self.endpoint_failed = error, endpoint_failed


# ----------------------------------------------------------------------------- the backend
class RemoteBackend(RewardBackend):
    """Scores jobs on HTTP endpoints (see the module docstring). One owner thread."""

    def __init__(self, config: RemoteHttpConfig, *, dispatch: Dispatch | None = None,
                 seed: int | None = None, batch_requests: int = 0) -> None:
        """``dispatch``: the order in which queued jobs start (dispatch.py; default
        FifoDispatch). Its "workers" are endpoint indices with a free slot.
        ``batch_requests``: trajectories per training batch, told to a shared service."""
        self.config, self.batch_requests = config, batch_requests
        self._headers = {"content-type": "application/json"}
        if config.auth_secret_file:
            self._headers[config.auth_header.lower()] = read_secret(config.auth_secret_file)
        self._tls = config.client_tls()  # ca_file, a client certificate: read now, TlsFileError if unusable
        b = config.breaker
        self.endpoints = [Endpoint(url, config.max_concurrency, Breaker(b.failures, b.open_s,
                                                                        b.half_open_probes))
                          for url in config.endpoints]
        self.dispatch = dispatch if dispatch is not None else FifoDispatch()
        self._rng = random.Random(seed)
        self._jobs: dict[str, _Job] = {}
        self._retry_ready: collections.deque[_Job] = collections.deque()
        self._tasks: set[asyncio.Task[None]] = set()
        self._reopen: asyncio.TimerHandle | None = None
        self._outcomes: list[RewardOutcome] = []
        self._lock = threading.Lock()
        self._signalled = False
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._client: httpx2.AsyncClient | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run_loop, args=(started,),
                                        name="reward-remote", daemon=True)
        self._thread.start()
        started.wait()

    # -- the owner's API ------------------------------------------------------------
    def submit(self, job: RewardJob) -> None:
        if not self._closed:
            self._loop.call_soon_threadsafe(self._accept, job)

    def poll(self, timeout: float = 0.0) -> list[RewardOutcome]:
        """Outcomes that are ready, waiting up to ``timeout`` for the first one."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if self._signalled:
                    _drain(self._rfd)
                    self._signalled = False
                out, self._outcomes = self._outcomes, []
            left = deadline - time.monotonic()
            if out or left <= 0 or self._closed:
                return out
            select.select([self._rfd], [], [], None if math.isinf(left) else left)

    def fds(self) -> list[int]:
        return [self._rfd]

    def next_deadline_in(self) -> float:
        return math.inf  # every deadline is the loop thread's; it announces on the fd

    def set_max_concurrency(self, n: int) -> None:
        """Change every endpoint's limit (a scaling plan); requests above a lowered
        limit finish, and no new one starts until the endpoint is below it."""
        if n < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {n}")
        self._loop.call_soon_threadsafe(self._set_limit, n)

    def resize(self, workers: int) -> None:
        """A pipeline stage's plan (pipeline_backend.py): ``workers`` requests at once
        over all endpoints, spread evenly (rounded up, at least one each)."""
        self.set_max_concurrency(max(1, -(-workers // len(self.endpoints))))

    def stats(self) -> list[dict[str, Any]]:
        """Per endpoint: url, circuit state, in_flight, limit, requests, failures (a
        snapshot read across threads: each number is current, not all at one instant)."""
        return [ep.snapshot() for ep in self.endpoints]

    def close(self) -> None:
        """Stop the loop; jobs not answered yet get no outcome (the daemon is draining:
        the env-hosts re-send what the trainer did not ack)."""
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        except Exception as exc:  # noqa: BLE001 — closing must not fail the daemon's drain
            log.warning("remote reward backend did not shut down cleanly: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        for fd in (self._rfd, self._wfd):
            os.close(fd)

    # -- the loop thread --------------------------------------------------------------
    def _run_loop(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        total = len(self.endpoints) * self.config.max_concurrency
        # No pool limit of its own (max_connections=None): the per-endpoint limits are the
        # limit, and a pool queue would hide time from the attempt timeouts.
        self._client = httpx2.AsyncClient(
            timeout=httpx2.Timeout(self.config.timeout_s,
                                   connect=min(self.config.connect_timeout_s, self.config.timeout_s)),
            limits=httpx2.Limits(max_connections=None, max_keepalive_connections=total),
            verify=self._tls if self._tls is not None else True, follow_redirects=False, trust_env=False)
        started.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    def _set_limit(self, n: int) -> None:
        for ep in self.endpoints:
            ep.limit = n
        self._pump()

    def _accept(self, job: RewardJob) -> None:
        st = self._jobs.get(job.key)
        if st is not None:  # the same trajectory again while in flight: one request
            st.waiters += 1
            return
        now = self._loop.time()
        st = self._jobs[job.key] = _Job(job, now, now + self.config.total_timeout_s,
                                        job_body(job, self.batch_requests))
        st.timer = self._loop.call_at(st.deadline, self._expire, st)
        self.dispatch.add(job)
        self._pump()

    def _pump(self) -> None:
        """Start what can start: retries first (they already had their turn in the
        dispatch's order), then the dispatch's picks, while an endpoint has a slot."""
        try:
            self._pump_once()
        except Exception:  # a dispatch bug: logged; the job deadlines still end every job
            log.exception("remote reward backend: dispatch failed")

    def _pump_once(self) -> None:
        now = self._loop.time()
        while self._retry_ready:
            i = self._choose(self._retry_ready[0], now)
            if i is None:
                break
            self._start(self._retry_ready.popleft(), i)
        while len(self.dispatch):
            idle = self._idle(now)
            picked = self.dispatch.pick(idle) if idle else None
            if picked is None:
                break
            i, job = picked
            if i not in idle:
                self.dispatch.requeue(job)
                raise ValueError(f"dispatch picked endpoint {i}, which is not among the idle {idle}")
            st = self._jobs.get(job.key)
            if st is not None and st.job is job and st.phase == "queued":
                self._start(st, i)
            # else: it ran out of time while queued and was answered already
        self._arm_reopen(now)

    def _idle(self, now: float) -> list[int]:
        """Endpoints with a free slot and a closed (or probing) circuit, least loaded first."""
        idle = [i for i, ep in enumerate(self.endpoints) if ep.available(now)]
        return sorted(idle, key=lambda i: self.endpoints[i].in_flight / self.endpoints[i].limit)

    def _choose(self, st: _Job, now: float) -> int | None:
        idle = self._idle(now)
        others = [i for i in idle if not st.tried or i != st.tried[-1]]
        return (others or idle or [None])[0]

    def _arm_reopen(self, now: float) -> None:
        """Work waits and circuits are open: look again when the first one half-opens."""
        if self._reopen is not None:
            self._reopen.cancel()
            self._reopen = None
        if not (self._retry_ready or len(self.dispatch)):
            return
        opens = [ep.breaker.open_until for ep in self.endpoints if ep.breaker.state == "open"]
        if opens:
            self._reopen = self._loop.call_at(max(min(opens), now), self._pump)

    def _start(self, st: _Job, i: int) -> None:
        ep = self.endpoints[i]
        probe = ep.breaker.state == "half_open"
        ep.in_flight += 1
        ep.probes_in_flight += probe
        st.phase = "running"
        st.attempts += 1
        st.tried.append(i)
        task = self._loop.create_task(self._attempt(st, ep, probe))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _attempt(self, st: _Job, ep: Endpoint, probe: bool) -> None:
        ep.requests += 1
        try:
            reward = await self._request(st, ep)
        except _Retry as r:
            self._failed(st, ep, r)
        except _Final as f:
            if f.endpoint_failed:
                self._endpoint_failure(ep)
            else:
                ep.breaker.success()
            ATTEMPTS.labels(ep.url, "final").inc()
            self._finish(st, 0.0, f.error)
        except asyncio.CancelledError:
            raise  # close(): no outcome
        except Exception as exc:  # noqa: BLE001 — our bug, not the endpoint's: a final error
            log.exception("remote reward attempt for %s failed", st.job.key)
            self._finish(st, 0.0, f"remote reward backend: {type(exc).__name__}: {exc}")
        else:
            if ep.breaker.state != "closed":
                log.info("reward endpoint %s answered: circuit closed", ep.url,
                         extra={"event": "reward_endpoint_closed"})
            ep.breaker.success()
            ATTEMPTS.labels(ep.url, "ok").inc()
            self._finish(st, reward, "")
        finally:
            CIRCUIT_OPEN.labels(ep.url).set(ep.breaker.state != "closed")
            ep.in_flight -= 1
            ep.probes_in_flight -= probe
            if not self._closed:
                self._pump()

    async def _request(self, st: _Job, ep: Endpoint) -> float:
        assert self._client is not None
        timeout = min(self.config.timeout_s, st.deadline - self._loop.time())
        headers = {**self._headers, "idempotency-key": st.job.key,
                   "x-rlfleet-attempt": str(st.attempts)}
        try:
            # asyncio.timeout bounds the whole attempt; httpx's own timeouts are per
            # read, so an endpoint trickling bytes would otherwise never time out.
            async with asyncio.timeout(max(timeout, 0.001)):
                resp = await self._client.post(
                    ep.url, content=st.body, headers=headers,
                    timeout=httpx2.Timeout(timeout, connect=min(self.config.connect_timeout_s, timeout)))
        except (TimeoutError, httpx2.TimeoutException):
            raise _Retry(f"{ep.url}: no answer within {timeout:.3g} s") from None
        except (httpx2.TransportError, ssl.SSLError) as exc:  # refused, reset, closed mid-answer;
            # SSLError: a TLS 1.3 alert after the handshake (no client certificate, a foreign
            # one) comes on the first read, which the HTTP client does not wrap.
            raise _Retry(f"{ep.url}: {type(exc).__name__}: {exc}") from None
        status, content = resp.status_code, resp.content
        if status == 200:
            try:
                return read_reward(content)
            except ValueError as exc:
                raise _Final(f"{ep.url}: {exc}", endpoint_failed=True) from None
        if retryable(status):
            raise _Retry(f"{ep.url}: {error_text(status, content)}", retry_after(resp.headers))
        raise _Final(f"{ep.url}: {error_text(status, content)}", endpoint_failed=False)

    def _endpoint_failure(self, ep: Endpoint) -> None:
        was = ep.breaker.state
        ep.failures += 1
        ep.breaker.failure(self._loop.time())
        if ep.breaker.state == "open" and was != "open":
            log.warning("reward endpoint %s: circuit open for %g s", ep.url, ep.breaker.open_s,
                        extra={"event": "reward_endpoint_open"})

    def _failed(self, st: _Job, ep: Endpoint, r: _Retry) -> None:
        self._endpoint_failure(ep)
        ATTEMPTS.labels(ep.url, "retry").inc()
        st.last_error = r.error
        retry = self.config.retry
        if st.attempts >= retry.max_attempts:
            self._finish(st, 0.0, f"{st.attempts} attempts failed; last: {r.error}")
            return
        delay = backoff_s(st.attempts, retry, self._rng, r.after_s)
        if self._loop.time() + delay >= st.deadline:
            self._finish(st, 0.0, f"total_timeout_s ({self.config.total_timeout_s:g}) leaves no "
                                  f"time for attempt {st.attempts + 1}; last: {r.error}")
            return
        st.phase = "backoff"
        self._loop.call_later(delay, self._backoff_over, st)

    def _backoff_over(self, st: _Job) -> None:
        if self._jobs.get(st.job.key) is st and st.phase == "backoff":
            st.phase = "retry"
            self._retry_ready.append(st)
            self._pump()

    def _expire(self, st: _Job) -> None:
        """The job's total_timeout_s is over. A running attempt's own timeout ends at
        the same deadline, so only waiting jobs are answered here."""
        if self._jobs.get(st.job.key) is not st or st.phase == "running":
            return
        if st.phase == "retry":
            self._retry_ready.remove(st)
        why = f"last: {st.last_error}" if st.last_error else \
              "every endpoint busy or its circuit open " + \
              ", ".join(f"{ep.url}={ep.breaker.state}" for ep in self.endpoints)
        self._finish(st, 0.0, f"not scored within total_timeout_s={self.config.total_timeout_s:g} "
                              f"({st.attempts} attempts; {why})")

    def _finish(self, st: _Job, reward: float, error: str) -> None:
        if self._jobs.get(st.job.key) is not st:
            return
        del self._jobs[st.job.key]
        st.phase = "done"
        if st.timer is not None:
            st.timer.cancel()
        outcome = RewardOutcome(st.job.key, reward, error[:_ERROR_CHARS],
                                self._loop.time() - st.submitted)
        with self._lock:
            self._outcomes.extend([outcome] * st.waiters)
            if not self._signalled:
                self._signalled = True
                try:
                    os.write(self._wfd, b"\0")
                except OSError:
                    pass  # closed: nobody polls any more


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass

