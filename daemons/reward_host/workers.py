"""Reward workers: a pool of processes that score trajectories with a hard timeout.

Why not concurrent.futures.ProcessPoolExecutor: it cannot kill one worker. A reward
function that loops forever would hold its worker for good, and killing a worker
breaks the whole executor. Here each worker is a plain child process
(`python -m rlfleet.daemons.reward_host.workers`) running one job at a time.

Batches: an idle worker is handed several queued jobs in one message (the queue split
evenly over the idle workers, at most `MAX_BATCH` each), because one pipe round trip
and one wake-up of the owner's loop per job cost more CPU than a rule reward itself.
The worker still answers each job as soon as it is done, so the pool always knows
which job is running and since when: each job has its own `timeout_s`, counted from
the previous answer of its batch (or the hand-over). A job that exceeds it has its
worker killed (SIGKILL) and is reported as `timeout after Xs`; the jobs of its batch
not answered yet go back to the front of the queue (Dispatch.requeue) and run on a
worker again, so each job gets exactly one outcome. A worker that dies by itself
(segfault, os._exit) likewise costs only the job it was running. A replacement
worker is started. Nothing in here raises into the caller: a pool that cannot start
workers keeps the jobs queued, logs, and retries with backoff.

Why plain subprocesses rather than multiprocessing: no fork() of a process that has
ZeroMQ and gRPC threads, no re-import of the parent's __main__, and no pickle — jobs
and outcomes cross the worker's stdin/stdout as length-prefixed msgpack (msgspec
structs; a batch is an array of encoded jobs, decoded one by one so a malformed job
fails alone). A worker says "ready" once its imports are done, so start-up time never
counts against a job's timeout, and a worker that cannot start costs no job.

The pool is driven by its owner's loop (`submit`, then `poll`); `fds()` lists the file
descriptors to wait on, so one zmq.Poller can cover sockets and workers alike.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import select
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any, BinaryIO

import msgspec

from rlfleet.common.wire.messages import Prompt

from .backends import RewardBackend
from .dispatch import Dispatch, FifoDispatch

log = logging.getLogger("rlfleet.reward_host")

_ERROR_CHARS = 500
_LEN = struct.Struct("<I")
_MAX_FRAME = 64 * 1024 * 1024
MAX_BATCH = 64  # jobs handed to one worker at once


class RewardJob(msgspec.Struct, frozen=True):
    key: str  # the trajectory id
    task: str
    difficulty: dict[str, Any]  # get_task keyword arguments
    prompt: Prompt  # as it arrived in the Trajectory
    texts: list[str]  # the completion of every turn
    tenant: str = ""  # the job (several may share a reward service; stages.RequestKey)
    batch: int = 0  # the training batch it is estimated to land in (service.batch_of)


class RewardOutcome(msgspec.Struct, frozen=True):
    key: str  # "" only in the worker's ready message
    reward: float
    error: str = ""  # non-empty: the reward could not be computed (reward is then 0.0)
    seconds: float = 0.0


RewardFn = Callable[[Any, Any, list[str]], float]  # (task, prompt, texts) -> reward


def _default_reward(task: Any, prompt: Any, texts: list[str]) -> float:
    return task.reward(prompt, texts)


def load_reward_fn(path: str | None) -> RewardFn:
    """'package.module:function' -> the function; None or '' -> task.reward."""
    if not path:
        return _default_reward
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"reward function must be 'module:function', got {path!r}")
    fn = getattr(importlib.import_module(module), attr)
    if not callable(fn):
        raise ValueError(f"{path} is not callable")
    return fn  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- worker side
def _write_frame(out: BinaryIO, body: bytes) -> None:
    out.write(_LEN.pack(len(body)) + body)
    out.flush()


def _read_frame(inp: BinaryIO) -> bytes | None:
    head = inp.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    body = inp.read(n)
    return body if len(body) == n else None


def _key_of(raw: bytes) -> str:
    try:
        key = msgspec.msgpack.decode(raw).get("key", "")
    except Exception:  # noqa: BLE001 — not even a map: the pool reports it by its own job
        return ""
    return key if isinstance(key, str) else ""


def worker_main(reward_fn_path: str | None) -> int:
    """A worker process: score jobs from stdin until it closes."""
    # The protocol gets private copies of stdin/stdout; a reward function that prints
    # writes to stderr instead of corrupting the frames.
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    from rlfleet.daemons.tasks import get_task

    batch_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])
    decoder = msgspec.msgpack.Decoder(RewardJob)
    encoder = msgspec.msgpack.Encoder()
    reward_fn = load_reward_fn(reward_fn_path)
    tasks: dict[str, Any] = {}
    _write_frame(proto_out, encoder.encode(RewardOutcome("", 0.0)))  # ready
    while (frame := _read_frame(proto_in)) is not None:
        try:
            batch = batch_decoder.decode(frame)
        except msgspec.DecodeError:
            return 2  # not the pool's protocol: the pool sees EOF and answers for the batch
        for raw in batch:
            # Answered one by one, flushed: the pool times each job from the previous answer.
            outcome = _score(bytes(raw), decoder, reward_fn, tasks, get_task)
            _write_frame(proto_out, encoder.encode(outcome))
    return 0


def _score(raw: bytes, decoder: msgspec.msgpack.Decoder, reward_fn: RewardFn,
           tasks: dict[str, Any], get_task: Callable[..., Any]) -> RewardOutcome:
    started = time.perf_counter()
    key = ""
    try:
        job = decoder.decode(raw)
        key = job.key
        cache_key = f"{job.task}:{sorted(job.difficulty.items())}"
        task = tasks.get(cache_key)
        if task is None:
            task = tasks[cache_key] = get_task(job.task, **job.difficulty)
        value = reward_fn(task, job.prompt, list(job.texts))
        reward = float(value)
        if not math.isfinite(reward):
            raise ValueError(f"reward function returned {value!r}")
        return RewardOutcome(key, reward, "", time.perf_counter() - started)
    except Exception as exc:  # noqa: BLE001 — the reward's failure is data, not our crash
        key = key or _key_of(raw)  # a job that failed to decode is still answered as itself
        error = f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]
        return RewardOutcome(key, 0.0, error, time.perf_counter() - started)


# ----------------------------------------------------------------------------- pool side
class _Worker:
    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        assert proc.stdout is not None and proc.stdin is not None
        self.fd = proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.buf = bytearray()
        self.ready = False
        # Handed over and not answered yet, in the order the worker runs them; the first
        # is running since `started` (the hand-over, or the previous answer).
        self.jobs: deque[RewardJob] = deque()
        self.spawned = time.monotonic()
        self.started = 0.0

    def frames(self) -> tuple[list[bytes], bool]:
        """Complete frames read so far, and whether the pipe reached EOF."""
        eof = False
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                eof = True
                break
            if not chunk:
                eof = True
                break
            self.buf += chunk
        out = []
        while len(self.buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self.buf)
            if n > _MAX_FRAME:
                return out, True  # a broken worker: treat as dead
            if len(self.buf) < _LEN.size + n:
                break
            out.append(bytes(self.buf[_LEN.size:_LEN.size + n]))
            del self.buf[:_LEN.size + n]
        return out, eof

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()  # type: ignore[union-attr]
            except OSError:
                pass
        try:
            self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            log.error("reward worker %d did not exit after SIGKILL", self.proc.pid)


class RewardPool(RewardBackend):
    """`workers` reward processes with a per-job hard timeout. One owner thread."""

    def __init__(self, workers: int, timeout_s: float, *, reward_fn: str | None = None,
                 dispatch: Dispatch | None = None) -> None:
        """``dispatch`` decides which queued job starts on which idle worker
        (dispatch.py; default FifoDispatch)."""
        if workers < 1:
            raise ValueError(f"workers: must be >= 1, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        load_reward_fn(reward_fn)  # a bad path fails here, once, with the path in the message
        self.size, self.timeout_s, self.reward_fn = workers, timeout_s, reward_fn or ""
        self._workers: list[_Worker] = []
        self.dispatch = dispatch if dispatch is not None else FifoDispatch()
        self._decoder = msgspec.msgpack.Decoder(RewardOutcome)
        self._encoder = msgspec.msgpack.Encoder()
        self._spawn_retry_at = 0.0
        self._spawn_backoff = 0.5
        self.killed = 0  # workers killed for a timeout
        self.died = 0  # workers that died by themselves
        self._closed = False
        self._fill()

    # -- the owner's API ------------------------------------------------------------
    def submit(self, job: RewardJob) -> None:
        """Queue a job; the next poll() hands the queue out, so jobs submitted together
        travel to a worker together."""
        self.dispatch.add(job)

    def poll(self, timeout: float = 0.0) -> list[RewardOutcome]:
        """Outcomes that are ready, waiting up to `timeout` for the first one."""
        deadline = time.monotonic() + timeout
        while True:
            out = self._step()
            left = deadline - time.monotonic()
            if out or left <= 0:
                return out
            self._wait(min(left, self.next_deadline_in()))

    def fds(self) -> list[int]:
        """File descriptors that become readable when poll() has something to do."""
        return [w.fd for w in self._workers]

    def next_deadline_in(self) -> float:
        """Seconds until the earliest running job times out (or a respawn is due)."""
        now = time.monotonic()
        due = [w.started + self.timeout_s - now for w in self._workers if w.jobs]
        if len(self._workers) < self.size and not self._closed:
            due.append(self._spawn_retry_at - now)
        return max(0.0, min(due, default=math.inf))

    @property
    def busy(self) -> int:
        return sum(bool(w.jobs) for w in self._workers)

    @property
    def queued(self) -> int:
        return len(self.dispatch)

    @property
    def ready(self) -> int:
        return sum(w.ready for w in self._workers)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def resize(self, workers: int) -> None:
        """Hold ``workers`` processes from now on (a scaling plan, pipeline.py): more are
        started at once; idle ones beyond it stop now, busy ones once their jobs are
        answered (a stop never kills a running job)."""
        self.size = max(0, workers)
        self._retire()
        self._fill()

    def close(self) -> None:
        self._closed = True
        for w in self._workers:
            try:
                w.proc.stdin.close()  # type: ignore[union-attr]  # a worker exits at EOF
            except OSError:
                pass
        deadline = time.monotonic() + 1.0
        for w in self._workers:
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            w.kill()
        self._workers.clear()

    # -- internals ----------------------------------------------------------------------
    def _step(self) -> list[RewardOutcome]:
        self._fill()
        out = self._collect()
        out += self._reap_timeouts()
        self._retire()
        self._hand_out()
        return out

    def _retire(self) -> None:
        """Stop idle workers beyond ``size``, those still starting first (they cost no
        warm worker). An idle worker has no job, so its SIGKILL loses nothing."""
        excess = len(self._workers) - self.size
        if excess <= 0:
            return
        idle = sorted((w for w in self._workers if not w.jobs), key=lambda w: w.ready)
        for w in idle[:excess]:
            w.kill()
            self._workers.remove(w)

    def _wait(self, timeout: float) -> None:
        fds = self.fds()
        if not fds:
            time.sleep(min(timeout, 0.05))
            return
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        poller.poll(None if math.isinf(timeout) else max(0, math.ceil(timeout * 1000)))

    def _fill(self) -> None:
        if self._closed or time.monotonic() < self._spawn_retry_at:
            return
        while len(self._workers) < self.size:
            cmd = [sys.executable, "-m", "rlfleet.daemons.reward_host.workers"]
            if self.reward_fn:
                cmd.append(self.reward_fn)
            try:
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env={**os.environ, "OMP_NUM_THREADS": "1"})
            except Exception as exc:  # noqa: BLE001 — out of fds/memory: keep the jobs, retry later
                self._spawn_failed(f"cannot start a reward worker: {exc}")
                return
            self._workers.append(_Worker(proc))

    def _spawn_failed(self, why: str) -> None:
        self._spawn_retry_at = time.monotonic() + self._spawn_backoff
        log.error("%s; retrying in %.1f s", why, self._spawn_backoff,
                  extra={"event": "worker_spawn_failed"})
        self._spawn_backoff = min(self._spawn_backoff * 2, 30.0)

    def _hand_out(self) -> None:
        """Give each idle worker its share of the queue, as the dispatch picks (pick
        is asked once per job; a worker stays on offer until its share is full)."""
        idle = [i for i, w in enumerate(self._workers) if w.ready and not w.jobs]
        if not idle or not len(self.dispatch):
            return
        share = min(MAX_BATCH, -(-len(self.dispatch) // len(idle)))
        batches: dict[int, list[RewardJob]] = {}
        while idle and (picked := self.dispatch.pick(idle)) is not None:
            i, job = picked
            if i not in idle:
                self.dispatch.requeue(job)
                for jobs in batches.values():
                    self._requeue(jobs)
                raise ValueError(f"dispatch picked worker {i}, which is not among the idle {idle}")
            batch = batches.setdefault(i, [])
            batch.append(job)
            if len(batch) >= share:
                idle.remove(i)
        for i, jobs in batches.items():
            w = self._workers[i]
            try:
                body = self._encoder.encode(jobs)
                w.proc.stdin.write(_LEN.pack(len(body)) + body)  # type: ignore[union-attr]
                w.proc.stdin.flush()  # type: ignore[union-attr]
            except OSError:  # the worker is gone; _collect reaps it, the jobs go back
                self._requeue(jobs)
                continue
            w.jobs.extend(jobs)
            w.started = time.monotonic()

    def _requeue(self, jobs: list[RewardJob] | deque[RewardJob]) -> None:
        """Back to the front of the queue, in their order."""
        for job in reversed(jobs):
            self.dispatch.requeue(job)

    def _collect(self) -> list[RewardOutcome]:
        out: list[RewardOutcome] = []
        now = time.monotonic()
        for w in list(self._workers):
            frames, eof = w.frames()
            for raw in frames:
                try:
                    outcome = self._decoder.decode(raw)
                except msgspec.DecodeError as exc:
                    outcome = RewardOutcome(w.jobs[0].key if w.jobs else "", 0.0,
                                            f"unreadable worker reply: {exc}")
                if not w.ready:
                    w.ready = True  # the hello; the worker takes jobs from now on
                    self._spawn_backoff = 0.5
                    continue
                if not w.jobs:
                    continue  # nothing was asked: ignore
                job = w.jobs.popleft()
                w.started = now  # the next job of the batch starts now
                if outcome.key != job.key:  # only a broken worker does this
                    outcome = RewardOutcome(job.key, 0.0, f"worker answered for {outcome.key!r}")
                out.append(outcome)
            if eof:
                self._lost(w, out)
        return out

    def _lost(self, w: _Worker, out: list[RewardOutcome]) -> None:
        w.kill()
        self._workers.remove(w)
        code = w.proc.returncode
        if not w.ready:
            self._spawn_failed(f"reward worker {w.proc.pid} exited during start-up (exit code {code})")
            return
        self.died += 1
        log.warning("reward worker %d died (exit code %s)", w.proc.pid, code,
                    extra={"event": "worker_died"})
        if w.jobs:  # the running job fails; the rest of its batch runs again elsewhere
            job = w.jobs.popleft()
            out.append(RewardOutcome(job.key, 0.0, f"reward worker died (exit code {code})",
                                     time.monotonic() - w.started))
            self._requeue(w.jobs)
            w.jobs.clear()

    def _reap_timeouts(self) -> list[RewardOutcome]:
        out = []
        now = time.monotonic()
        for w in list(self._workers):
            if w.jobs and now - w.started > self.timeout_s:
                job = w.jobs.popleft()
                self.killed += 1
                log.warning("reward for %s exceeded %.3g s: killing worker %d", job.key,
                            self.timeout_s, w.proc.pid, extra={"event": "worker_killed"})
                out.append(RewardOutcome(job.key, 0.0, f"timeout after {self.timeout_s:g}s",
                                         now - w.started))
                w.kill()
                self._workers.remove(w)
                self._requeue(w.jobs)  # not started, or not answered before the kill: again
                w.jobs.clear()
        if out:
            self._fill()
        return out


if __name__ == "__main__":
    raise SystemExit(worker_main(sys.argv[1] if len(sys.argv) > 1 else None))
