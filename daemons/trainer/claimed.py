"""Which prompts exist: [0, next) of the prompt cursor in etcd, every one claimed by some
env-host. A trajectory for a prompt at or past ``next`` was made up by its sender (a
squat on a group a real env-host will fill later): the intake refuses it.

The cursor is read again only when an arrival names a prompt past the last value read,
so a trainer pays one etcd read per new claim range at most, none per trajectory. While
etcd cannot answer, the check is skipped (``None``), counted and logged: refusing would
stall training through an outage, and only a key of the reward-host role reaches the
trainer's socket at all (common/wire/edges.py).
"""

from __future__ import annotations

import logging
import time

from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.records import PromptCursor
from rlfleet.common.control.store import Store, StoreUnavailable
from rlfleet.common.log_throttle import LogThrottle

log = logging.getLogger("rlfleet.trainer")

RETRY_S = 5.0  # while etcd is away, one read (up to its timeout) per this many seconds, not per batch


class ClaimedPrompts:
    def __init__(self, store: Store, keys: JobKeys) -> None:
        self.store, self.keys = store, keys
        self.next = 0          # prompts below this were claimed, as last read
        self.unverified = 0    # arrivals let through unchecked while etcd was away
        self._errors = LogThrottle(30.0)
        self._retry_at = 0.0  # after a failed read: no other until then (each could block the intake)

    def below(self, prompt_id: int) -> int | None:
        """The cursor's ``next`` once it is known to be past ``prompt_id`` (or the last
        value read, when even etcd's is not); None when etcd cannot be read."""
        if prompt_id < self.next:
            return self.next
        if time.monotonic() < self._retry_at:
            self.unverified += 1
            return None
        try:
            kv = self.store.get(self.keys.prompts_cursor)
        except StoreUnavailable as exc:
            self._retry_at = time.monotonic() + RETRY_S
            self.unverified += 1
            self._errors.warning(log, "cursor", "cannot check prompt %d against the claims (etcd: %s); "
                                 "let through unchecked", prompt_id, exc, extra={"event": "claims_unchecked"})
            return None
        cursor = PromptCursor.parse(kv.value) if kv is not None else PromptCursor()
        if not cursor.problem:
            self.next = max(self.next, cursor.next)
        return self.next
