"""Prompt claims on a real etcd: racing claimers never overlap, the cursor stays small."""

from __future__ import annotations

import json
import threading

import pytest

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.store import StoreUnavailable
from rlfleet.daemons.env_host.claims import (
    MAX_OWNERS,
    RECENT_PER_OWNER,
    ClaimError,
    PromptClaimer,
    parse_cursor,
)
from tests.integration.helpers import CountingStore

KEYS = JobKeys("claims")


def test_racing_claimers_get_disjoint_ranges_covering_the_cursor(etcd):
    n_claimers, claims_each = 4, 25
    got: dict[str, list[range]] = {}
    claimers = []
    start = threading.Barrier(n_claimers)

    def work(owner: str) -> None:
        store = EtcdStore(etcd.endpoints)  # one client each: four independent env-hosts
        claimer = PromptClaimer(store, KEYS, owner)
        claimers.append(claimer)
        start.wait()
        got[owner] = [claimer.claim(1 + i % 3) for i in range(claims_each)]
        store.close()

    threads = [threading.Thread(target=work, args=(f"env-{i}",)) for i in range(n_claimers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)

    ids = [i for ranges in got.values() for r in ranges for i in r]
    assert len(ids) == len(set(ids)), "two env-hosts claimed the same prompt"
    with EtcdStore(etcd.endpoints) as store:
        nxt, recorded = parse_cursor(store.get(KEYS.prompts_cursor).value)
    assert sorted(ids) == list(range(nxt))  # no gaps either: every id went to someone
    assert set(recorded) == set(got)
    assert sum(c.conflicts for c in claimers) > 0, "the claimers never actually raced"


class _Interloper(EtcdStore):
    """A real store through which another env-host claims between our read and our swap."""

    def __init__(self, endpoints: str, other: PromptClaimer) -> None:
        super().__init__(endpoints)
        self.other, self.fired = other, False

    def swap(self, key, expected_mod_revision, value, lease=None):
        if not self.fired:
            self.fired = True
            self.other.claim(5)
        return super().swap(key, expected_mod_revision, value, lease)


def test_a_lost_swap_is_retried_from_the_new_cursor(etcd):
    with EtcdStore(etcd.endpoints) as plain:
        other = PromptClaimer(plain, KEYS, "env-b")
        store = _Interloper(etcd.endpoints, other)
        mine = PromptClaimer(store, KEYS, "env-a")
        assert mine.claim(3) == range(5, 8)  # env-b took [0, 5) while we were deciding
        assert mine.conflicts == 1
        assert mine.recent() == [range(5, 8)] and other.recent() == [range(0, 5)]
        store.close()


class _AmbiguousSwap(EtcdStore):
    """A real store whose next swap is applied in etcd but reported as failed, the way a
    txn that times out after etcd applied it is (``raise_``), or as lost, the way the
    store's own retry of an applied txn loses to its first write."""

    def __init__(self, endpoints: str, raise_: bool) -> None:
        super().__init__(endpoints)
        self.raise_, self.armed = raise_, True

    def swap(self, key, expected_mod_revision, value, lease=None):
        won, kv = super().swap(key, expected_mod_revision, value, lease)
        if self.armed and won:
            self.armed = False
            if self.raise_:
                raise StoreUnavailable("etcd swap: deadline exceeded (applied all the same)")
            return False, self.get(key)  # what the retry of the applied txn sees
        return won, kv


@pytest.mark.parametrize("raise_", [True, False], ids=["timed-out", "retried"])
def test_a_claim_applied_but_reported_failed_is_not_lost(etcd, raise_):
    # Under load an etcd txn can time out after it was applied (the cause of the env-host
    # restart test's rare "claimed prompt neither delivered nor journaled"): the range is
    # recorded as ours in etcd, so the claimer must hand it out, not claim past it.
    with _AmbiguousSwap(etcd.endpoints, raise_) as store:
        claimer = PromptClaimer(store, KEYS, "env-a")
        got = []
        if raise_:
            with pytest.raises(StoreUnavailable):
                claimer.claim(4)
        else:
            got.append(claimer.claim(4))
        got += [claimer.claim(4), claimer.claim(2)]
        nxt, _ = parse_cursor(store.get(KEYS.prompts_cursor).value)
    ids = [i for r in got for i in r]
    assert sorted(ids) == list(range(nxt)), f"claimed in etcd but never handed out: {got}, next {nxt}"
    assert claimer.recovered == 1


def test_cursor_value_stays_small_and_readable(etcd):
    with EtcdStore(etcd.endpoints) as store:
        a = PromptClaimer(store, KEYS, "env-a")
        for _ in range(10):
            a.claim(2)  # contiguous: merged into one range
        assert a.recent() == [range(0, 20)]
        for i in range(MAX_OWNERS + 10):
            PromptClaimer(store, KEYS, f"env-{i}").claim(1)
            a.claim(1)  # interleaved: separate ranges, only the last few kept
        value = store.get(KEYS.prompts_cursor).value
        assert len(value["claims"]) == MAX_OWNERS
        assert len(value["claims"]["env-a"]) == RECENT_PER_OWNER
        assert len(json.dumps(value)) < 4096
        assert value["next"] == 20 + 2 * (MAX_OWNERS + 10)


def test_malformed_cursor_is_refused_and_left_alone(etcd):
    with EtcdStore(etcd.endpoints) as store:
        store.put(KEYS.prompts_cursor, {"next": "seven"})
        with pytest.raises(ClaimError, match=r"prompts/cursor.next: expected an integer >= 0, got 'seven'"):
            PromptClaimer(store, KEYS, "env-a").claim(1)
        assert store.get(KEYS.prompts_cursor).value == {"next": "seven"}
        store.put(KEYS.prompts_cursor, {"next": 3, "claims": {"x": [[2, 9]]}})
        with pytest.raises(ClaimError, match="claims.x"):
            PromptClaimer(store, KEYS, "env-a").claim(1)


def test_claim_needs_a_positive_count(etcd):
    with EtcdStore(etcd.endpoints) as store:
        with pytest.raises(ValueError, match="k: must be >= 1, got 0"):
            PromptClaimer(store, KEYS, "env-a").claim(0)


def test_a_claim_is_one_swap_and_a_paced_claim_asks_etcd_nothing(etcd):
    allowed = {"n": 6}
    with CountingStore(etcd.endpoints) as store, EtcdStore(etcd.endpoints) as other_store:
        mine = PromptClaimer(store, KEYS, "env-a", budget=lambda nxt: allowed["n"] - nxt)
        assert mine.claim(4) == range(0, 4)
        assert store.calls == ["get", "swap"]  # the first claim reads the cursor once
        store.calls.clear()
        assert mine.claim(4) == range(4, 6)  # budget: 2 more
        assert mine.claim(4) == range(6, 6)  # paced
        assert mine.claim(4) == range(6, 6)
        assert store.calls == ["swap"]  # the paced claims decided on what this claimer wrote

        # Another env-host claimed meanwhile: the stale swap loses and says where the cursor
        # is; the retry goes at once (no back-off: nobody raced us, we were behind).
        assert PromptClaimer(other_store, KEYS, "env-b").claim(3) == range(6, 9)
        allowed["n"] = 20
        store.calls.clear()
        assert mine.claim(4) == range(9, 13)
        assert store.calls == ["swap", "swap"] and mine.conflicts == 1
        nxt, recorded = parse_cursor(store.get(KEYS.prompts_cursor).value)
        assert nxt == 13 and recorded == {"env-a": [[0, 6], [9, 13]], "env-b": [[6, 9]]}


def test_a_repaired_cursor_is_read_again(etcd):
    with EtcdStore(etcd.endpoints) as store:
        claimer = PromptClaimer(store, KEYS, "env-a")
        assert claimer.claim(2) == range(0, 2)
        store.put(KEYS.prompts_cursor, {"next": "seven"})
        with pytest.raises(ClaimError, match="prompts/cursor.next"):
            claimer.claim(1)  # the swap at the old revision lost and showed the bad value
        store.put(KEYS.prompts_cursor, {"next": 7, "claims": {}})  # an operator repairs it
        assert claimer.claim(1) == range(7, 8)
