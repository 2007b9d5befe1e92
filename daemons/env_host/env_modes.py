"""Env modes: how the episodes of one env-host wait for each other between turns.

``async`` (the default, ROLL Flash §5.2.1 "environment-level asynchronous rollout"): each
trajectory steps its environment as soon as its own action is generated, and asks for its
next action as soon as its own environment answered. Nothing waits for anything else.

``batch`` (the baseline of ROLL Flash §5.2.1 and RollArt R2): the trajectories of a batch
step together, with a barrier after every turn: nobody asks for turn k+1 until every
trajectory of its batch still running has stepped turn k. A batch is the prompts the
env-host claimed together (``round``, see runner.py); one slow or hung environment holds
the whole batch, which is what the asynchronous mode removes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

ENV_MODES = ("async", "batch")


class TurnGate:
    """Where an episode waits between turns. The default lets it go on at once (env-level
    asynchrony: each trajectory steps its environment on its own, ROLL Flash §5.2.1);
    ``env_modes.BatchBarrier`` holds it until its whole batch has stepped (the ``batch``
    baseline)."""

    async def after_step(self, tid: str, turn: int) -> None:
        """Turn ``turn`` of ``tid`` has been stepped and the episode goes on."""

    def leave(self, tid: str) -> None:
        """``tid`` has ended (done or dropped): nobody waits for it any more."""


class BatchBarrier(TurnGate):
    """A barrier per batch, released when every member still running has arrived.

    Members are announced with ``join`` before any of them starts (the runner joins a
    whole round at once), so the first to arrive cannot be released alone; a member
    that ends (done, dropped, cancelled as redundant) ``leave``s and is no longer waited
    for."""

    def __init__(self, batch_of: Callable[[str], int]) -> None:
        self.batch_of = batch_of
        self._members: dict[int, set[str]] = {}
        self._waiting: dict[int, set[str]] = {}
        self._release: dict[int, asyncio.Future[None]] = {}
        self.rounds = 0  # barriers released, for tests and metrics

    def join(self, tids: Iterable[str]) -> None:
        for tid in tids:
            self._members.setdefault(self.batch_of(tid), set()).add(tid)

    async def after_step(self, tid: str, turn: int) -> None:
        batch = self.batch_of(tid)
        if tid not in self._members.get(batch, ()):
            return  # not announced (e.g. resumed after a restart): it does not wait
        self._waiting.setdefault(batch, set()).add(tid)
        release = self._release.get(batch)
        if release is None:
            release = self._release[batch] = asyncio.get_running_loop().create_future()
        self._check(batch)
        await asyncio.shield(release)

    def leave(self, tid: str) -> None:
        batch = self.batch_of(tid)
        members = self._members.get(batch)
        if members is None or tid not in members:
            return
        members.discard(tid)
        self._waiting.get(batch, set()).discard(tid)
        if not members:
            self._members.pop(batch, None)
            self._waiting.pop(batch, None)
        self._check(batch)

    def _check(self, batch: int) -> None:
        waiting = self._waiting.get(batch, set())
        members = self._members.get(batch, set())
        release = self._release.get(batch)
        if release is not None and waiting >= members:
            self._release.pop(batch)
            self._waiting.pop(batch, None)
            self.rounds += 1
            if not release.done():
                release.set_result(None)
