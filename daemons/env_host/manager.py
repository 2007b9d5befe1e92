"""EnvManager: one asyncio task drives one trajectory from reset to done.

    obs = env.reset(prompt)
    loop:  text = task.format_turn(obs) -> token ids -> GenerateRequest to a rollout
           -> check the result -> completion text -> env.step(completion) -> journal the turn
    until done, then return the Trajectory (dropped ones too, with dropped_reason set).

Faults stay inside the trajectory and end it with a recorded reason (docs/design/dataflow.md):

    env_error           reset/step raised or returned something that is not a step result
    env_timeout         reset/step took longer than turn_timeout_s
    rollout_garbage     results kept failing the checks in `check_result` (after retries)
    rollout_timeout     rollouts kept timing out / disappearing (after retries)
    trajectory_timeout  the whole episode exceeded trajectory_timeout_s
    env_host_error      a bug of ours (logged with its traceback)

Environment calls run on `EnvThreads` rather than `asyncio.to_thread`: the default
executor has cpu+4 threads that a few hung environments would use up for good, and its
threads are joined at interpreter exit, so one hung env would block shutdown. A task
whose env is microseconds of pure computation (Task.env_calls_inline: arithmetic) is
called on the loop instead: no hop, and no env_timeout either, since it cannot hang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec

from rlfleet.common.spec.job import JobSpec
from rlfleet.common.wire.arrays import Float32Array, Int32Array
from rlfleet.common.wire.messages import GenerateRequest, GenerateResult, Segment, Trajectory, Turn
from rlfleet.daemons.tasks import AsyncTaskEnv, Prompt, Task, TaskEnv, undecoded_action
from rlfleet.daemons.tasks.prompts import group_id, trajectory_id

from .env_modes import TurnGate
from .env_threads import EnvThreads
from .routing import RouteError, Router
from .turn_codec import TurnCodec

log = logging.getLogger("rlfleet.env_host")

_ERROR_CHARS = 300  # of an exception's text kept in a trajectory's info
_MAX_CONTINUATIONS = 32  # interruptions of one trajectory before it is given up


@dataclasses.dataclass(frozen=True)
class ManagerConfig:
    turn_timeout_s: float = 30.0
    trajectory_timeout_s: float = 300.0
    max_retries: int = 3
    temperature: float = 1.0
    top_p: float = 1.0
    backoff_s: float = 0.1  # first retry delay; doubles per retry
    max_backoff_s: float = 5.0
    # An interrupted turn waits this long for a rollout holding its version, then is
    # generated again from scratch.
    continue_timeout_s: float = 5.0
    mode: str = "trajectory"  # [rollout] mode
    prompts_per_batch: int = 1  # trainer.batch_size // group_size

    @classmethod
    def from_spec(cls, spec: JobSpec) -> ManagerConfig:
        e = spec.env_host
        return cls(turn_timeout_s=e.turn_timeout_s, trajectory_timeout_s=e.trajectory_timeout_s,
                   max_retries=e.max_retries, temperature=spec.rollout.temperature,
                   top_p=spec.rollout.top_p, continue_timeout_s=min(5.0, e.turn_timeout_s),
                   mode=spec.rollout.mode,
                   prompts_per_batch=max(1, spec.trainer.batch_size // spec.task.group_size))

    def required_version(self, prompt_id: int) -> int | None:
        """The barrier modes' version for a prompt: its batch's (sync) or the one before
        (one_step_off: batch n+1 is generated while n trains). None: any version."""
        batch = prompt_id // self.prompts_per_batch
        if self.mode == "sync":
            return batch
        if self.mode == "one_step_off":
            return max(0, batch - 1)
        return None


def _cut(segments: list[Segment], n: int) -> list[Segment]:
    """The segments of the first n tokens."""
    out, left = [], n
    for seg in segments:
        if left <= 0:
            break
        out.append(Segment(min(seg.tokens, left), seg.version))
        left -= seg.tokens
    return out if len({s.version for s in out}) > 1 or len(out) > 1 else []


def check_result(res: GenerateResult, vocab_size: int, max_new_tokens: int) -> str | None:
    """Why a rollout's result is unusable, or None if it is fine."""
    if res.finish_reason == "error":
        return f"finish_reason error: {res.error[:_ERROR_CHARS]}"
    n = len(res.token_ids)
    if n == 0:
        return "no tokens"
    if n > max_new_tokens:
        return f"{n} tokens > max_new_tokens {max_new_tokens}"
    if len(res.logprobs) != n:
        return f"{len(res.logprobs)} logprobs for {n} tokens"
    # min/max/sum run in C; a Python test per element cost the env-host more CPU than the
    # rest of a turn's bookkeeping. The exact scan runs only to name the bad values.
    ids = res.token_ids.tolist()
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        return f"token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
    logprobs = res.logprobs.tolist()
    # A finite sum means every value is finite (a NaN or an infinity makes it NaN or
    # infinite), and then max() is exact; a sum that overflows falls back to the scan.
    if not (math.isfinite(sum(logprobs)) and max(logprobs) <= 1e-4) and \
            not all(math.isfinite(x) and x <= 1e-4 for x in logprobs):
        return "logprobs not finite or > 0"
    if res.weight_version < 0:
        return f"weight_version {res.weight_version} < 0"
    return None


_THREADS = EnvThreads()


class Dropped(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


OnTurn = Callable[[str, int, Turn], Awaitable[None]]


_NO_GATE = TurnGate()


class EnvManager:
    """One trajectory: ``await EnvManager(...).run()`` returns it, finished or dropped.

    ``resume`` are turns journaled before a restart: they are replayed on a fresh
    environment (their recorded actions, no generation) and the episode continues; if
    the replay does not reproduce the recorded observations, the episode restarts.
    ``on_turn(tid, index, turn)`` is awaited after every finished turn (the journal).
    """

    def __init__(self, *, task: Task, prompt: Prompt, prompt_id: int, index: int,
                 codec: TurnCodec, router: Router, config: ManagerConfig,
                 on_turn: OnTurn | None = None, resume: Sequence[Turn] = (),
                 threads: EnvThreads | None = None, gate: TurnGate | None = None) -> None:
        self.task, self.prompt, self.prompt_id = task, prompt, prompt_id
        self.tid = trajectory_id(prompt_id, index)
        self.codec, self.router, self.cfg = codec, router, config
        self.on_turn = on_turn
        self.resume = list(resume)
        self.threads = threads or _THREADS
        self.gate = gate or _NO_GATE
        self.turns: list[Turn] = []
        self.env_reward = 0.0
        self.invalid_actions = 0
        self.reissues = 0
        self.continuations = 0  # interrupted generations continued (repack, drain)
        self.repack_overheads: list[float] = []
        self.regenerated: list[str] = []  # why a turn was generated again from scratch
        self.rollouts_used: list[str] = []

    async def run(self) -> Trajectory:
        reason, detail = "", ""
        try:
            async with asyncio.timeout(self.cfg.trajectory_timeout_s):
                await self._play()
        except TimeoutError:
            reason, detail = "trajectory_timeout", f"episode exceeded {self.cfg.trajectory_timeout_s:g} s"
        except Dropped as d:
            reason, detail = d.reason, d.detail
        except Exception as exc:  # noqa: BLE001 — a bug here must cost one trajectory, not the host
            log.exception("%s: unexpected error", self.tid, extra={"trajectory": self.tid})
            reason, detail = "env_host_error", repr(exc)[:_ERROR_CHARS]
        finally:
            self.gate.leave(self.tid)
        if reason:
            log.info("%s dropped: %s: %s", self.tid, reason, detail,
                     extra={"event": "trajectory_dropped", "trajectory": self.tid, "reason": reason})
        return self._trajectory(reason, detail)

    def ended(self, reason: str, detail: str) -> Trajectory:
        """The trajectory as far as it got, ended from outside (cancelled as redundant)."""
        return self._trajectory(reason, detail)

    def _trajectory(self, reason: str, detail: str) -> Trajectory:
        info = {"turns": str(len(self.turns)), "invalid_actions": str(self.invalid_actions),
                "reissues": str(self.reissues), "rollouts": ",".join(dict.fromkeys(self.rollouts_used))}
        if self.continuations:
            info["continuations"] = str(self.continuations)
        if self.repack_overheads:
            info["repack_overhead_s"] = ",".join(f"{x:g}" for x in self.repack_overheads)
        if self.regenerated:
            info["regenerated"] = "; ".join(self.regenerated)[:_ERROR_CHARS]
        if detail:
            info["error"] = detail
        return Trajectory(self.tid, self.prompt_id, group_id(self.prompt_id), self.task.name,
                          list(self.turns), self.env_reward, info, reason, prompt=self.prompt)

    # -- the episode ------------------------------------------------------------------
    async def _play(self) -> None:
        env, obs, done = await self._start()
        while not done:
            if len(self.turns) >= self.task.max_turns:
                raise Dropped("env_error", f"episode not done after {len(self.turns)} turns "
                                           f"(task max_turns {self.task.max_turns})")
            prompt_ids = self.codec.prompt_array(self.task.format_turn(obs))
            rollout_id, res = await self._generate(prompt_ids)
            ids = res.token_ids.tolist()
            n, action = self.codec.completion(ids, decode=self.task.decodes_completion)
            if not self.task.decodes_completion:
                action = undecoded_action(self.tid, len(self.turns))
            if n == len(ids):  # all of it (the usual case): the received arrays as they are
                turn = Turn(prompt_ids, res.token_ids, res.logprobs, res.weight_version, obs, action,
                            res.segments)
            else:
                turn = Turn(prompt_ids, Int32Array(ids[:n]), Float32Array(res.logprobs.tolist()[:n]),
                            res.weight_version, obs, action, _cut(res.segments, n))
            next_obs, reward, done, info = await self._step(env, action)
            self.rollouts_used.append(rollout_id)
            self.invalid_actions += bool(info.get("invalid_action"))
            await self._append(turn, reward)
            obs = next_obs
            if not done:
                await self.gate.after_step(self.tid, len(self.turns))

    async def _start(self) -> tuple[TaskEnv, str, bool]:
        """A reset environment, brought to the end of the journaled turns if there are any."""
        # Both may be slow: off the loop, in one call (one thread hop per episode start
        # instead of two; a hop costs the loop more than a small env's make_env + reset).
        env, obs = await self._env_call("make_env/reset", self._new_env)
        if not isinstance(obs, str):
            raise Dropped("env_error", f"reset returned {type(obs).__name__}, not str")
        resume, self.resume = self.resume, []
        for n, turn in enumerate(resume):
            if turn.observation != obs:
                log.warning("%s: replay diverged at turn %d, restarting the episode", self.tid, n,
                            extra={"trajectory": self.tid})
                self.turns, self.env_reward, self.invalid_actions = [], 0.0, 0
                return await self._start()
            obs, reward, done, info = await self._step(env, turn.action)
            self.turns.append(turn)
            self.env_reward += reward
            self.invalid_actions += bool(info.get("invalid_action"))
            if done:
                return env, obs, True
        return env, obs, False

    def _new_env(self) -> tuple[TaskEnv, Any]:
        env = self.task.make_env()
        return env, env.reset(self.prompt)

    async def _append(self, turn: Turn, reward: float) -> None:
        if self.on_turn is not None:
            await self.on_turn(self.tid, len(self.turns), turn)
        self.turns.append(turn)
        self.env_reward += reward

    async def _step(self, env: TaskEnv, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if isinstance(env, AsyncTaskEnv):
            result = await self._env_await("step", env.astep(action))
        else:
            result = await self._env_call("step", env.step, action)
        try:
            obs, reward, done, info = result
            reward = float(reward)
            if not isinstance(obs, str) or not math.isfinite(reward) or not isinstance(info, dict):
                raise TypeError
        except (TypeError, ValueError):
            raise Dropped("env_error", f"step returned {result!r:.100}, not "
                                       "(observation: str, reward: finite, done, info: dict)") from None
        return obs, reward, bool(done), info

    async def _env_await(self, what: str, call: Awaitable[Any]) -> Any:
        """An AsyncTaskEnv's call, on the loop, under the turn timeout."""
        # asyncio.timeout runs the call in this task; wait_for wrapped it in a Task of its
        # own (created, scheduled, and a callback to wake us): one per step of every episode.
        try:
            async with asyncio.timeout(self.cfg.turn_timeout_s):
                return await call
        except TimeoutError:
            raise Dropped("env_timeout", f"env.{what} took longer than "
                                         f"{self.cfg.turn_timeout_s:g} s") from None
        except Exception as exc:  # noqa: BLE001 — the env's own exception
            raise Dropped("env_error", f"env.{what} raised {type(exc).__name__}: "
                                       f"{str(exc)[:_ERROR_CHARS]}") from None

    async def _env_call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        if self.task.env_calls_inline:
            # The task vouches that its env is microseconds of pure computation: a call on
            # the loop costs less than the hop to a thread and back (~0.1 ms of loop time).
            try:
                return fn(*args)
            except Exception as exc:  # noqa: BLE001 — the env's own exception
                raise Dropped("env_error", f"env.{what} raised {type(exc).__name__}: "
                                           f"{str(exc)[:_ERROR_CHARS]}") from None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def settle(value: Any, exc: BaseException | None) -> None:
            if not fut.done():
                if exc is None:
                    fut.set_result(value)
                else:
                    fut.set_exception(exc)

        def target() -> None:
            try:
                value, exc = fn(*args), None
            except BaseException as e:  # noqa: BLE001 — carried back to the trajectory
                value, exc = None, e
            try:
                loop.call_soon_threadsafe(settle, value, exc)
            except RuntimeError:
                pass  # the loop is gone (env-host stopping): nobody waits for this any more

        self.threads.submit(target)
        try:
            return await asyncio.wait_for(fut, self.cfg.turn_timeout_s)
        except TimeoutError:
            # The thread may run on forever; it is a daemon thread and holds only this env.
            self.threads.hung += 1
            raise Dropped("env_timeout", f"env.{what} took longer than "
                                         f"{self.cfg.turn_timeout_s:g} s") from None
        except Dropped:
            raise
        except Exception as exc:  # noqa: BLE001 — the env's own exception
            raise Dropped("env_error", f"env.{what} raised {type(exc).__name__}: "
                                       f"{str(exc)[:_ERROR_CHARS]}") from None

    async def _generate(self, prompt_ids: Int32Array) -> tuple[str, GenerateResult]:
        """One turn's generation; Dropped when retries run out.

        An interrupted generation (finish_reason "abort": a repack moved it, its rollout
        drained) comes back with its tokens and version, and goes on from there on a
        rollout holding that same version — the repack's destination when it names one
        (``continue_on``). Only when no rollout holds it within continue_timeout_s is the
        turn generated again from scratch on whatever version serves, and the reason is
        recorded in the trajectory's info (``regenerated``). A rollout that died takes its
        tokens with it: that turn is re-issued from scratch elsewhere, as before.
        """
        turn = _TurnInProgress(prompt_ids, self.task.max_new_tokens_for(self.prompt) + 1,  # +1: the end token
                               self.cfg.required_version(self.prompt_id))
        exclude: set[str] = set()
        reason, detail = "", ""
        attempt = 0
        while attempt <= self.cfg.max_retries:
            if attempt and reason:
                # Garbage may be a transient engine fault: back off before asking again. A
                # timeout or a lost rollout already cost time: re-issue elsewhere at once.
                delay = min(self.cfg.max_backoff_s, self.cfg.backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(delay * random.uniform(0.5, 1.0)
                                    if reason == "rollout_garbage" else 0.0)
            req = turn.request(f"{self.tid}-t{len(self.turns)}-a{attempt}-c{turn.pieces}", self.tid,
                               self.cfg.temperature, self.cfg.top_p)
            continuing = turn.continuing
            waited = time.monotonic() - turn.interrupted_at if continuing else 0.0
            try:
                rollout_id, res = await self.router.generate(
                    req, self.cfg.continue_timeout_s if continuing else self.cfg.turn_timeout_s,
                    exclude, to=turn.destination if continuing else None,
                    version=turn.version if continuing else None, tag=self.task.tag(self.prompt))
            except RouteError as exc:
                if continuing and exc.kind == "no_rollout":
                    if turn.destination:  # the named destination is gone: any holder will do
                        turn.destination = ""
                        continue
                    self._regenerate(turn, f"no rollout holds weight version {turn.version}")
                    continue
                attempt += 1
                self.reissues += 1
                if exc.rollout_id:
                    exclude.add(exc.rollout_id)
                reason, detail = "rollout_timeout", str(exc)
                continue
            if res.finish_reason == "version":  # it moved on from the version we need
                exclude.add(rollout_id)
                if continuing:
                    turn.destination = ""
                elif turn.required is not None:  # a barrier mode's batch version has gone
                    self._regenerate(turn, f"{rollout_id}: {res.error[:_ERROR_CHARS]}")
                continue
            problem = check_result(res, self.codec.vocab_size, req.max_new_tokens)
            if problem is not None and not (res.finish_reason == "abort" and not len(res.token_ids)):
                attempt += 1
                self.reissues += 1
                exclude.add(rollout_id)
                reason, detail = "rollout_garbage", f"{rollout_id}: {problem}"
                log.warning("%s: garbage from rollout %s: %s", self.tid, rollout_id, problem,
                            extra={"trajectory": self.tid, "rollout": rollout_id})
                continue
            self.rollouts_used.append(rollout_id)
            if continuing and turn.by_repack:
                # Interrupted until the continuation was sent, plus its queue and prefill
                # on the destination: Laminar's "repack overhead" (Table 1).
                self.repack_overheads.append(round(waited + res.first_token_s, 4))
            if res.finish_reason != "abort":
                return rollout_id, turn.finish(res)
            if not len(res.token_ids) and not turn.continuing:
                # Cut before its first token (queued on a repack source, a draining
                # rollout): nothing to continue, no version to keep. Ask again, anywhere.
                exclude.add(rollout_id)
                self.continuations += 1
                if self.continuations > _MAX_CONTINUATIONS:
                    raise Dropped("rollout_timeout", f"interrupted {self.continuations} times")
                continue
            # Interrupted: keep what it made and go on with the same version.
            self.continuations += 1
            if not turn.carry(res, time.monotonic()):
                self._regenerate(turn, "interrupted too often")
            exclude.discard(res.continue_on)
            if self.continuations > _MAX_CONTINUATIONS:
                raise Dropped("rollout_timeout", f"interrupted {self.continuations} times")
        raise Dropped(reason, f"after {self.cfg.max_retries + 1} attempts: {detail}")

    def _regenerate(self, turn: _TurnInProgress, why: str) -> None:
        log.info("%s: turn %d generated again from scratch: %s", self.tid, len(self.turns), why,
                 extra={"trajectory": self.tid, "event": "regenerated"})
        self.regenerated.append(why[:_ERROR_CHARS])
        turn.restart()


class _TurnInProgress:
    """The pieces of one turn's generation so far (continuations append to it)."""

    def __init__(self, prompt_ids: Int32Array, max_new: int, required: int | None) -> None:
        self.prompt_ids, self.max_new, self.required = prompt_ids, max_new, required
        self.restart()

    def restart(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.segments: list[Segment] = []
        self.version: int | None = None  # the version a continuation must use
        self.destination = ""  # a repack's named destination
        self.by_repack = False
        self.interrupted_at = 0.0
        self.pieces = 0

    @property
    def continuing(self) -> bool:
        return self.version is not None

    def request(self, request_id: str, tid: str, temperature: float, top_p: float) -> GenerateRequest:
        if not self.tokens:
            prompt = self.prompt_ids
        else:
            prompt = Int32Array(self.prompt_ids.tolist() + self.tokens)
        required = self.version if self.version is not None else self.required
        return GenerateRequest(request_id, tid, prompt, self.max_new - len(self.tokens), temperature,
                               top_p, required_version=required, prefix_tokens=len(self.tokens))

    def carry(self, res: GenerateResult, now: float) -> bool:
        """Keep an interrupted result's tokens; False when nothing is left to generate."""
        self._append(res)
        self.version = res.segments[-1].version if res.segments else res.weight_version
        self.destination = res.continue_on
        self.by_repack = bool(res.continue_on)
        self.interrupted_at = now
        self.pieces += 1
        return len(self.tokens) < self.max_new

    def _append(self, res: GenerateResult) -> None:
        n = len(res.token_ids)
        if not n:
            return
        self.tokens += res.token_ids.tolist()
        self.logprobs += res.logprobs.tolist()
        self.segments += res.segments or [Segment(n, res.weight_version)]

    def finish(self, res: GenerateResult) -> GenerateResult:
        if not self.tokens:
            return res
        self._append(res)
        segments = _joined(self.segments)
        return msgspec.structs.replace(
            res, token_ids=Int32Array(self.tokens), logprobs=Float32Array(self.logprobs),
            weight_version=segments[0].version, segments=segments)


def _joined(segments: list[Segment]) -> list[Segment]:
    """Adjacent segments of one version as one (a continuation on the same version)."""
    out: list[Segment] = []
    for seg in segments:
        if out and out[-1].version == seg.version:
            out[-1] = Segment(out[-1].tokens + seg.tokens, seg.version)
        else:
            out.append(seg)
    return out
