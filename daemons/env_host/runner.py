"""The env-host's event loop (its own thread): claim prompts, run EnvManagers, hand
finished trajectories to the outbox, forget them once the reward-host acked.

Capacity (env mode "async"): at most max_concurrent trajectories run at once, counted by
trajectory, not by prompt: a prompt whose other trajectories still run does not hold the
slots of its finished ones (with slow, uneven environments a prompt's slowest trajectory
would otherwise idle the rest of its group's slots). A prompt stays live until all its
trajectories are acked, and at most twice max(1, max_concurrent // group_size) prompts
are live, so a reward-host that stops acking stops the claiming (back-pressure) instead
of piling up work. In the "batch" env mode a round is claimed when the previous ones
have left room for a whole round of live prompts.

Start-up order matters for the accounting invariant:
1. resume the journal's live prompts (re-send done trajectories, resume partial ones);
2. adopt claims the cursor records for us that the journal never saw (a crash between
   the compare-and-swap and the journal write) — before any new claim moves past them;
3. then claim new prompts as capacity frees up.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import Counter

from rlfleet.common.control.store import StoreUnavailable
from rlfleet.common.log_throttle import LogThrottle
from rlfleet.common.wire.messages import Trajectory, Turn
from rlfleet.common.wire.outbox import Acked
from rlfleet.daemons.tasks import Prompt, Task
from rlfleet.daemons.tasks.prompts import PromptStream, parse_trajectory_id, trajectory_id

from .claims import ClaimContention, ClaimError
from .env_modes import BatchBarrier, TurnGate
from .groups import REDUNDANT, PromptGroup, Round
from .journal import TrajectoryJournal
from .loop_lag import LoopLagProbe
from .loop_thread import LoopThread
from .manager import EnvManager, ManagerConfig, TurnCodec
from .routing import Router
from .routing_policy import RoutingPolicy

log = logging.getLogger("rlfleet.env_host")

TRAJECTORIES = Counter("rlfleet_env_trajectories_total",
                       "Trajectories finished by this env-host, by dropped reason ('' = complete)",
                       ["id", "reason"])
SPARES = Counter("rlfleet_env_spare_trajectories_total",
                 "Trajectories of redundant rollouts kept by this env-host, not handed on (docs/guide/agentic.md)",
                 ["id", "reason"])
PROMPTS_CLAIMED = Counter("rlfleet_env_prompts_claimed_total", "Prompts claimed from the cursor", ["id"])
TURNS = Counter("rlfleet_env_turns_total", "Turns generated and stepped", ["id"])


class EnvRunner:
    def __init__(self, *, task: Task, stream: PromptStream, codec: TurnCodec, config: ManagerConfig,
                 group_size: int, max_concurrent: int, journal: TrajectoryJournal,
                 claim: Callable[[int], range], recent_claims: Callable[[], list[range]],
                 submit: Callable[[str, Trajectory], None], name: str = "env-host",
                 routing: RoutingPolicy | None = None, env_mode: str = "async",
                 redundant_samples: int = 0, redundant_prompts: int = 0) -> None:
        """``env_mode``: "async" or "batch" (env_modes.py); ``redundant_samples`` extra
        trajectories per prompt, ``redundant_prompts`` extra prompts per batch-mode round
        (groups.py)."""
        self.task, self.stream, self.codec, self.config = task, stream, codec, config
        self.group_size = group_size
        self.launch = group_size + redundant_samples  # trajectories per prompt
        self.max_prompts = max(1, max_concurrent // self.launch)
        self.max_concurrent = max(max_concurrent, self.launch)
        self.env_mode = env_mode
        # A batch-mode round: the prompts of a training batch plus the redundant ones.
        self.round_size = min(self.max_prompts, config.prompts_per_batch + redundant_prompts)
        self._rounds: dict[int, Round] = {}  # round id (its first prompt id) -> round
        self._round_of: dict[int, int] = {}  # prompt id -> round id
        self._groups: dict[int, PromptGroup] = {}  # live prompt id -> its group's bookkeeping
        self._running: dict[str, tuple[asyncio.Task[Any], EnvManager]] = {}
        self._cancelled: set[str] = set()  # tids cancelled as redundant (not a shutdown)
        self.gate: TurnGate = (BatchBarrier(lambda tid: self._round_of.get(parse_trajectory_id(tid)[0], -1))
                               if env_mode == "batch" else TurnGate())
        self.journal = journal
        self.claim, self.recent_claims, self.submit = claim, recent_claims, submit
        self.name, self.routing = name, routing
        self._loop_thread = LoopThread("env loop", self._main, self._begin_stop, self._close_router)
        self.loop = self._loop_thread.loop
        self.router: Router | None = None
        self._journal_exec = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="journal")
        self._stopping = False
        self._rollouts: dict[str, str] = {}
        self._live: dict[int, set[str]] = {}  # prompt id -> its trajectories not yet acked
        self._tasks: set[asyncio.Task[Any]] = set()
        self._wake: asyncio.Event | None = None
        # counters (read from other threads; ints are updated atomically under the GIL)
        self.running = 0
        self.claimed = 0
        self.paced = 0  # claims the pacer refused (pacing.py), for tests and logs
        self.held_back = 0  # passes of the claim loop that found no room (back-pressure)
        self.newest_weights = 0  # the newest weight version a turn was generated with
        self.acked = 0
        self.first_acked_at: float | None = None  # wall time: `rlfleet node add`'s first trajectory
        self.dropped: dict[str, int] = {}
        self.spares: dict[str, int] = {}  # kept, not handed on, by reason
        self.last_claim_error = ""
        self._in_flight = 0  # mirrors of self._live, for other threads
        self._live_prompts = 0
        self._flush_scheduled = False
        self._acked_keys: collections.deque[str] = collections.deque()  # acked, not yet forgotten
        self._forget_pending = False
        # Finished while the journal's disk was full: handed on once their line is written.
        self._held: list[tuple[str, Trajectory, str, int]] = []
        self._journal_errors = LogThrottle(10.0)
        # Metric children looked up once, not per turn / trajectory (.labels() costs a lock
        # and a dict lookup on a tuple of label values).
        self._turns_metric = TURNS.labels(id=name)
        self._trajectories_metric: dict[str, Any] = {}
        self.lag_probe = LoopLagProbe(name, running=lambda: self.running)

    # -- thread-safe entry points -----------------------------------------------------
    def start(self) -> None:
        self._loop_thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._loop_thread.stop(timeout_s)
        self._journal_exec.shutdown(wait=True)

    def alive(self) -> bool:
        return self._loop_thread.alive()

    @property
    def error(self) -> BaseException | None:
        """What ended the loop, if anything did."""
        return self._loop_thread.error

    def set_rollouts(self, rollouts: Mapping[str, str], versions: Mapping[str, int] | None = None) -> None:
        """{rollout id: requests address} and the weight versions their records state, from etcd."""
        self._rollouts = dict(rollouts)
        self._versions = dict(versions or {})
        self._loop_thread.call(self._apply_rollouts)

    def on_acked(self, acked: list[Acked]) -> None:
        """Called on the outbox thread: journal the acks, then free capacity."""
        ok = [k for k, good, _ in acked if good]
        refused = [(k, err) for k, good, err in acked if not good]
        try:
            self.journal.record_acked(ok)
            for key, err in refused:
                log.warning("%s refused by the reward-host: %s", key, err, extra={"trajectory": key})
                self.journal.record_acked([key], ok=False, error=err)
        except OSError as exc:
            # A full disk: the lines wait in the journal. Forgetting goes on (else the prompt
            # stays live for good); a crash before the write re-sends, and receivers dedup.
            self._journal_errors.warning(log, "ack", "acks not journaled yet: %s", exc,
                                         extra={"event": "journal_full"})
        if acked and self.first_acked_at is None:
            self.first_acked_at = time.time()
        self.acked += len(acked)
        # One wake-up of the loop (a write to its self-pipe) per pass of the loop, not
        # per ack: keys pile up in a deque (thread-safe) while a wake-up is pending; the
        # flag is cleared before the deque is emptied, so a key is never left behind (a
        # spare wake-up is harmless).
        self._acked_keys.extend([k for k, _, _ in acked])
        if not self._forget_pending and self._loop_thread.alive():
            self._forget_pending = True
            self._loop_thread.call(self._forget_acked)

    def wake(self) -> None:
        """From any thread: look for work now (e.g. the trainer consumed groups, so the
        claim pacer allows more claims)."""
        self._loop_thread.call(self._poke)

    @property
    def in_flight(self) -> int:
        """Trajectories claimed and not yet acked (running, or waiting for the reward-host)."""
        return self._in_flight

    @property
    def live_prompts(self) -> int:
        return self._live_prompts

    # -- the loop (on its own thread, loop_thread.py) -----------------------------------
    def _close_router(self) -> None:
        """Close the rollout clients before the loop's tasks unwind (loop_thread.py)."""
        if self.router is not None:
            self.router.close()
            self.router = None

    def _begin_stop(self) -> None:
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()  # partial trajectories stay in the journal; a restart resumes them
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _apply_rollouts(self) -> None:
        if self.router is not None:
            for sentence in self.router.update(self._rollouts, getattr(self, "_versions", None)):
                log.info(sentence, extra={"event": "rollouts"})
            self._poke()

    async def _main(self) -> None:
        self._wake = asyncio.Event()
        self._lag_task = self.loop.create_task(self.lag_probe.run())  # cancelled in _shutdown
        self.router = Router(name=self.name, policy=self.routing)
        self._apply_rollouts()
        # The journal's own work first: it needs no etcd.
        for prompt_id in self.journal.live_prompts():
            if self._stopping:
                return
            await self._start_prompt(prompt_id)
        for prompts in await self._adopt_lost_claims():
            for prompt_id in prompts:
                await self._start_prompt(prompt_id)
        backoff = 0.2
        # Claim in batches (half the capacity) rather than one prompt per finished group:
        # fewer compare-and-swaps on the one cursor key that every env-host contends for.
        batch = max(1, self.max_prompts // 4) if self.env_mode == "async" else self.round_size
        while not self._stopping:
            if self._held:
                await self._hand_on_held()
            if self.env_mode == "async":
                free = min(2 * self.max_prompts - len(self._live),
                           (self.max_concurrent - self.running) // self.launch)
            else:
                free = self.max_prompts - len(self._live)
            if free >= batch and len(self.router) > 0:
                try:
                    prompts = await asyncio.to_thread(self.claim, free)
                except (StoreUnavailable, ClaimError, ClaimContention) as exc:
                    if str(exc) != self.last_claim_error:
                        log.warning("cannot claim prompts: %s", exc, extra={"event": "claim_failed"})
                    self.last_claim_error = str(exc)
                    await self._sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                backoff, self.last_claim_error = 0.2, ""
                if not prompts:  # paced: the trainer has enough outstanding; wake() on progress
                    self.paced += 1
                    await self._sleep(1.0)
                    continue
                await self._journal_claim(prompts)
                self.claimed += len(prompts)
                PROMPTS_CLAIMED.labels(id=self.name).inc(len(prompts))
                log.info("claimed prompts [%d, %d)", prompts.start, prompts.stop,
                         extra={"event": "claimed", "start": prompts.start, "stop": prompts.stop})
                if self.env_mode == "batch":
                    self._begin_round(prompts)
                for prompt_id in prompts:
                    await self._start_prompt(prompt_id)
                    # Let the loop run between prompts: a claim at 2,000 concurrent is ~60
                    # prompts, ~500 trajectories whose first turns (env reset, encode, send)
                    # would otherwise all run in one pass and hold every other one up.
                    await asyncio.sleep(0)
                continue
            self.held_back += 1
            await self._sleep(1.0)
        # Cancelled managers unwind in _shutdown (their journaled turns stay for the next start).

    async def _sleep(self, seconds: float) -> None:
        assert self._wake is not None
        try:
            async with asyncio.timeout(seconds):
                await self._wake.wait()
        except TimeoutError:
            pass
        self._wake.clear()

    async def _adopt_lost_claims(self) -> list[range]:
        """Journal the ranges etcd says are ours but the journal never saw; returns them."""
        backoff = 0.2
        while not self._stopping:
            try:
                recent = await asyncio.to_thread(self.recent_claims)
                break
            except (StoreUnavailable, ClaimError) as exc:
                log.warning("cannot read the prompt cursor yet: %s", exc)
                await self._sleep(backoff)
                backoff = min(backoff * 2, 5.0)
        else:
            return []
        adopted = []
        for r in recent:
            lost = range(max(r.start, self.journal.claimed_to), r.stop)
            if lost:
                log.warning("adopting prompts [%d, %d) claimed in etcd but not journaled",
                            lost.start, lost.stop, extra={"event": "adopted"})
                await self._journal_claim(lost)
                adopted.append(lost)
        return adopted

    def _begin_round(self, prompts: range) -> None:
        """Batch mode: the prompts claimed together step together (BatchBarrier), and with
        redundant prompts the round closes once a batch's worth of groups is complete."""
        needed = min(len(prompts), self.config.prompts_per_batch)
        self._rounds[prompts.start] = Round(list(prompts), needed)
        for p in prompts:
            self._round_of[p] = prompts.start
        assert isinstance(self.gate, BatchBarrier)
        self.gate.join(trajectory_id(p, k) for p in prompts for k in range(self.launch))

    async def _start_prompt(self, prompt_id: int) -> None:
        prompt = self.stream.cached(prompt_id)
        if prompt is None:  # generating a new chunk of the stream takes a while: off the loop
            prompt = await asyncio.to_thread(self.stream.get, prompt_id)
        live = self._live.setdefault(prompt_id, set())
        group = self._groups[prompt_id] = PromptGroup(self.group_size, self.launch)
        group.handed, group.good = self.journal.handed(prompt_id)
        for k in range(self.launch):
            tid = trajectory_id(prompt_id, k)
            status = self.journal.status(tid)
            if status == "acked":
                self.gate.leave(tid)
                continue
            live.add(tid)
            if status == "done":
                self.gate.leave(tid)
                self.submit(tid, self.journal.finished(tid, prompt))
            else:
                resume = self.journal.turns(tid) if status == "partial" else []
                group.running += 1
                self.running += 1  # counted from creation: the claim loop reads it at once
                task = self.loop.create_task(self._trajectory(prompt, prompt_id, k, resume))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        if not live:
            del self._live[prompt_id]
            self._groups.pop(prompt_id, None)
        self._count_live()

    def _count_live(self) -> None:
        self._in_flight = sum(len(t) for t in self._live.values())
        self._live_prompts = len(self._live)

    async def _trajectory(self, prompt: Prompt, prompt_id: int, k: int, resume: list[Turn]) -> None:
        assert self.router is not None
        manager = EnvManager(task=self.task, prompt=prompt, prompt_id=prompt_id, index=k,
                             codec=self.codec, router=self.router, config=self.config,
                             on_turn=self._journal_turn, resume=resume, gate=self.gate)
        tid = manager.tid
        self._running[tid] = (asyncio.current_task(), manager)  # type: ignore[assignment]
        try:
            try:
                traj = await manager.run()
            except asyncio.CancelledError:
                if tid not in self._cancelled:
                    raise  # the env-host is stopping: the journal keeps the partial trajectory
                self._cancelled.discard(tid)
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                traj = manager.ended(REDUNDANT, "cancelled: its group or round no longer needs it")
            group = self._groups[prompt_id]
            verdict = group.finished(ok=not traj.dropped_reason)
            if verdict == "spare":
                reason = traj.dropped_reason or REDUNDANT
                record = lambda: self.journal.record_spare(tid, reason)  # noqa: E731
                self.spares[reason] = self.spares.get(reason, 0) + 1
                SPARES.labels(id=self.name, reason=reason).inc()
            else:
                if traj.dropped_reason:
                    self.dropped[traj.dropped_reason] = self.dropped.get(traj.dropped_reason, 0) + 1
                metric = self._trajectories_metric.get(traj.dropped_reason)
                if metric is None:
                    metric = self._trajectories_metric[traj.dropped_reason] = TRAJECTORIES.labels(
                        id=self.name, reason=traj.dropped_reason)
                metric.inc()
                record = lambda: self.journal.record_done(traj)  # noqa: E731 — no fsync, see _journal_turn
            try:
                record()
            except OSError as exc:  # a full disk: the line waits in the journal, the trajectory here
                self._held.append((tid, traj, verdict, prompt_id))
                self._journal_errors.warning(log, "held", "%s held until the journal can be written: %s",
                                             tid, exc, extra={"event": "journal_full"})
                return
        except Exception:  # noqa: BLE001 — e.g. the journal's disk is full
            # Not handed on: the prompt stays live here and in the journal, and the next
            # start resumes the trajectory from what was journaled.
            log.exception("%s: could not journal the finished trajectory", tid)
            return
        finally:
            self.running -= 1
            self._running.pop(tid, None)
            self._poke()  # a trajectory's slot is free: maybe claim
        self._hand_on(tid, traj, verdict, prompt_id)

    def _hand_on(self, tid: str, traj: Trajectory, verdict: str, prompt_id: int) -> None:
        if verdict == "spare":
            self._forget([tid])
        else:
            self.submit(tid, traj)
        self._cancel_unneeded(prompt_id)

    async def _hand_on_held(self) -> None:
        """Only what the journal can rebuild leaves this host: the held trajectories go
        once their lines (kept in memory by the journal, in order) are written."""
        try:
            await self._in_journal(self.journal.flush)
        except OSError:
            return
        held, self._held = self._held, []
        log.info("the journal is written again: %d held trajectories handed on", len(held),
                 extra={"event": "journal_written"})
        for item in held:
            self._hand_on(*item)

    async def _journal_claim(self, prompts: range) -> None:
        try:
            await self._in_journal(self.journal.record_claim, prompts)
        except OSError as exc:
            # The journal keeps the line for its next write; a crash before then is covered
            # by adopting the claim from etcd at the next start (_adopt_lost_claims).
            self._journal_errors.warning(log, "claim", "claim [%d, %d) not journaled yet: %s",
                                         prompts.start, prompts.stop, exc, extra={"event": "journal_full"})

    def _cancel_unneeded(self, prompt_id: int) -> None:
        """Cancel what a whole group, or a round with enough groups, no longer needs."""
        group = self._groups.get(prompt_id)
        rid = self._round_of.get(prompt_id)
        rnd = self._rounds.get(rid) if rid is not None else None
        if (rnd is not None and not rnd.abandoned and group is not None and group.complete
                and rnd.group_complete(prompt_id)):
            rnd.abandoned = True
            for p in rnd.prompts:
                g = self._groups.get(p)
                if g is not None and not g.complete:
                    g.abandoned = True
                    self._cancel_prompt(p)
        if group is not None and group.cancel_now():
            self._cancel_prompt(prompt_id)

    def _cancel_prompt(self, prompt_id: int) -> None:
        for k in range(self.launch):
            tid = trajectory_id(prompt_id, k)
            running = self._running.get(tid)
            if running is not None and tid not in self._cancelled:
                self._cancelled.add(tid)
                running[0].cancel()

    async def _journal_turn(self, tid: str, index: int, turn: Turn) -> None:
        self._turns_metric.inc()
        if turn.weight_version > self.newest_weights:  # read by the claim pacer (pacing.lag_limit)
            self.newest_weights = turn.weight_version
        # Inline, not on the journal thread: a turn record is one os.write() with no fsync
        # (microseconds), while the hop to the writer thread and back cost the loop more
        # than the write. Claims, which are fsynced, still go through _in_journal. The
        # write itself is deferred to the end of this loop pass, so that it shares one
        # write() with the "done" record that usually follows at once (single-turn tasks)
        # and with other trajectories' records; nothing leaves this host in between.
        self.journal.record_turn(tid, index, turn, defer=True)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush_journal)

    def _flush_journal(self) -> None:
        self._flush_scheduled = False
        try:
            self.journal.flush()
        except OSError as exc:  # a full disk: the lines wait for the next write
            self._journal_errors.warning(log, "flush", "could not write the journal: %s", exc,
                                         extra={"event": "journal_full"})

    async def _in_journal(self, fn: Callable[..., None], *args: Any) -> None:
        # fsynced writes off the loop, in order (one writer thread).
        await self.loop.run_in_executor(self._journal_exec, fn, *args)

    def _forget_acked(self) -> None:
        self._forget_pending = False
        tids = []
        with contextlib.suppress(IndexError):
            while True:
                tids.append(self._acked_keys.popleft())
        self._forget(tids)

    def _forget(self, tids: list[str]) -> None:
        for tid in tids:
            prompt_id, _ = parse_trajectory_id(tid)
            live = self._live.get(prompt_id)
            if live is not None:
                live.discard(tid)
                if not live:
                    del self._live[prompt_id]
                    self._groups.pop(prompt_id, None)
                    rid = self._round_of.pop(prompt_id, None)
                    rnd = self._rounds.get(rid) if rid is not None else None
                    if rnd is not None and not any(p in self._live for p in rnd.prompts):
                        del self._rounds[rid]
        self._count_live()
        self._poke()
