"""Prompt claims: env-hosts take disjoint ranges of prompt ids through one etcd key.

`prompts/cursor` (common/records.PromptCursor) holds (JSON, readable with etcdctl)::

    {"next": 96, "claims": {"env-host-0": [[64, 72], [80, 88]], "env-host-1": [[88, 96]]}}

`next` is the first unclaimed prompt id; a claim of k prompts is a compare-and-swap
from `next` to `next + k` at the key's mod revision, so two env-hosts never get the
same id. `claims` keeps the last few ranges per env-host id (merged when contiguous)
and exists for crash recovery: an env-host killed between a successful swap and its
journal write finds the range here on restart (`recent()`). It is bounded, so the
value stays small however long the job runs.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.records import PromptCursor
from rlfleet.common.control.store import Store

log = logging.getLogger("rlfleet.env_host")

RECENT_PER_OWNER = 4  # ranges kept per env-host id
MAX_OWNERS = 64  # env-host ids kept; the one that claimed least recently is forgotten first


class ClaimError(Exception):
    """The cursor value is not what env-hosts write; we refuse to overwrite it."""


class ClaimContention(Exception):
    """Lost the compare-and-swap race max_attempts times in a row."""


def parse_cursor(value: Any) -> tuple[int, dict[str, list[list[int]]]]:
    """(next, claims) from a cursor value; ClaimError with the reason if malformed."""
    return _usable(PromptCursor.parse(value))


def _usable(cursor: PromptCursor) -> tuple[int, dict[str, list[list[int]]]]:
    """(next, claims) in the mutable form `_record` edits; ClaimError for a malformed
    cursor, which a claim must never write over (it would repeat or lose prompts)."""
    if cursor.problem:
        raise ClaimError(cursor.problem)
    value = cursor.to_value()
    return value["next"], value["claims"]


def _record(claims: dict[str, list[list[int]]], owner: str, start: int, end: int) -> None:
    ranges = claims.pop(owner, [])  # re-inserted last: dict order = least recent first
    if ranges and ranges[-1][1] == start:
        ranges[-1] = [ranges[-1][0], end]
    else:
        ranges.append([start, end])
    claims[owner] = ranges[-RECENT_PER_OWNER:]
    while len(claims) > MAX_OWNERS:
        claims.pop(next(iter(claims)))


class PromptClaimer:
    """Claims prompt ranges for one env-host. Blocking (etcd round trips): call it
    from a thread, not from an event loop. StoreUnavailable propagates."""

    def __init__(self, store: Store, keys: JobKeys, owner: str, *, max_attempts: int = 100,
                 budget: Callable[[int], int] | None = None) -> None:
        """``budget(next)``: how many prompts may be claimed with the cursor at ``next``
        (pacing.ClaimPacer.budget); None: no limit."""
        self.store, self.keys, self.owner = store, keys, owner
        self.max_attempts = max_attempts
        self.budget = budget
        self.conflicts = 0  # lost swaps, for metrics and tests
        self.recovered = 0  # swaps reported failed or lost that had in fact been applied
        self._cursor: PromptCursor | None = None
        # The range of a swap whose outcome we never learnt (etcd timed out): it may have
        # been applied, and then it is ours whatever the next call asks for.
        self._uncertain: range | None = None

    def claim(self, k: int) -> range:
        """The next k unclaimed prompt ids, now ours; fewer (maybe none: an empty range)
        when the budget says so."""
        if k < 1:
            raise ValueError(f"k: must be >= 1, got {k}")
        key = self.keys.prompts_cursor
        # The cursor as this claimer last wrote or saw it: the swap is made at its revision
        # without reading first (a stale one only loses the swap, which returns the cursor
        # as it stands). `next` only grows and the budget only shrinks as it grows, so a
        # budget of nothing at a stale `next` is nothing at the real one too: a paced
        # env-host re-checks its budget without asking etcd.
        cursor = self._cursor
        if self._uncertain is not None:
            cursor = None  # read the cursor: did that swap land?
        for attempt in range(self.max_attempts):
            fresh = cursor is None
            if fresh:
                cursor = PromptCursor.read(self.store, self.keys) or PromptCursor()  # none yet: from 0
            try:
                nxt, claims = _usable(cursor)
            except ClaimError:
                self._cursor = None  # read it again next time: an operator may repair it
                raise
            if self._uncertain is not None:
                landed, self._uncertain = self._recorded(claims, self._uncertain), None
                if landed:
                    self.recovered += 1
                    log.warning("prompts [%d, %d): the claim reported failed had been applied; "
                                "they are ours", landed.start, landed.stop, extra={"event": "claim_recovered"})
                    return landed
            n = k if self.budget is None else min(k, self.budget(nxt))
            if n <= 0:
                return range(nxt, nxt)
            wanted = range(nxt, nxt + n)
            _record(claims, self.owner, nxt, nxt + n)
            # A swap that times out may still have been applied; and the store's retry of
            # one that was applied loses to its own write. Either way only the cursor can
            # tell, and only this owner ever records ranges under its own name.
            self._uncertain = wanted
            won, kv = self.store.swap(key, cursor.mod_revision, {"next": nxt + n, "claims": claims})
            self._uncertain = None
            cursor = self._cursor = PromptCursor.from_kv(kv) if kv is not None else PromptCursor()
            if won:
                return wanted
            if self._recorded(_usable(cursor)[1] if not cursor.problem else {}, wanted):
                self.recovered += 1
                log.warning("prompts [%d, %d): the claim's swap was retried after it had been "
                            "applied; they are ours", nxt, nxt + n, extra={"event": "claim_recovered"})
                return wanted
            self.conflicts += 1
            if fresh or attempt:
                # Another env-host won; jittered so a crowd of claimers spreads out.
                time.sleep(random.uniform(0, 0.002 * min(attempt + 1, 10)))
        raise ClaimContention(f"{key}: lost {self.max_attempts} compare-and-swap races in a row")

    def _recorded(self, claims: dict[str, list[list[int]]], wanted: range) -> range | None:
        """``wanted`` if the cursor records it as this owner's claim."""
        covered = any(a <= wanted.start and wanted.stop <= b for a, b in claims.get(self.owner, []))
        return wanted if covered else None

    def recent(self) -> list[range]:
        """The ranges the cursor records for this env-host (most recent last)."""
        cursor = PromptCursor.read(self.store, self.keys)
        if cursor is None:
            return []
        _, claims = _usable(cursor)
        return [range(a, b) for a, b in claims.get(self.owner, [])]
