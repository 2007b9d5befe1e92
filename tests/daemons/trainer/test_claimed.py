"""ClaimedPrompts: prompts past the cursor are refused; while etcd is away the check is
skipped, and the intake does not wait on a dead etcd for every batch."""

from __future__ import annotations

from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.store import KeyValue, StoreUnavailable
from rlfleet.daemons.trainer.claimed import ClaimedPrompts

KEYS = JobKeys("claimed")


class Store:
    def __init__(self) -> None:
        self.next, self.down, self.reads = 10, False, 0

    def get(self, key: str):
        self.reads += 1
        if self.down:
            raise StoreUnavailable("etcd get: no endpoint answered")
        return KeyValue(key, {"next": self.next, "claims": {}}, 1, 1)


def test_reads_only_past_the_last_value_and_backs_off_while_etcd_is_away():
    store = Store()
    claimed = ClaimedPrompts(store, KEYS)  # type: ignore[arg-type]
    assert claimed.below(3) == 10 and claimed.below(9) == 10 and store.reads == 1
    store.next = 20
    assert claimed.below(15) == 20 and store.reads == 2
    store.down = True
    assert [claimed.below(25) for _ in range(5)] == [None] * 5
    assert store.reads == 3 and claimed.unverified == 5  # one failed read, then no more for RETRY_S
    assert claimed.below(12) == 20  # below what is known: no read needed
