"""ChainFollower on a real etcd: the chain it derives from watch events is the chain a
fresh read gives, also when the watch replays events older than its last reload."""

from __future__ import annotations

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.relay.topology import ChainFollower, read_chain

KEYS = JobKeys("topology")


def _relay(store: EtcdStore, rid: str, newest: int, state: str = "running") -> None:
    store.put(KEYS.member("relay", rid), {"id": rid, "role": "relay", "host": "h", "state": state,
                                          "addresses": {"chunks": f"tcp://127.0.0.1:{9000 + int(rid[-1])}"},
                                          "shm_dir": f"/dev/shm/{rid}", "newest": newest})


def _drain(watches, follower: ChainFollower, expect: int) -> None:
    """Apply events until `expect` of them came (each put below is one event)."""
    got = 0
    while got < expect:
        for w in watches:
            event = w.get(timeout=0.2)
            if event is not None:
                follower.apply(event)
                got += 1


def test_the_followed_chain_matches_a_fresh_read(etcd):
    with EtcdStore(etcd.endpoints) as store:
        start = store.revision() + 1
        _relay(store, "relay-1", 3)
        _relay(store, "relay-2", 3)
        store.put(KEYS.relay_master, {"id": "relay-2", "since": 1.0, "newest": 3})
        _relay(store, "relay-1", 4)  # newer than the replayed put of relay-1
        watches = [store.watch_prefix(KEYS.role_members_prefix("relay"), start_revision=start),
                   store.watch_prefix(KEYS.relay_prefix, start_revision=start)]
        follower = ChainFollower(KEYS)
        follower.reload(store)
        assert follower.chain() == read_chain(store, KEYS)
        _drain(watches, follower, 4)  # the replay of what the reload already read
        assert follower.chain() == read_chain(store, KEYS)
        assert follower.chain().members["relay-1"].newest == 4  # not stepped back to 3

        _relay(store, "relay-3", 4)
        store.put(KEYS.relay_layout(2), {"layout": 2, "requested_by": "h", "at": 1.0})
        store.delete(KEYS.relay_master)
        _relay(store, "relay-2", 4, state="draining")
        _drain(watches, follower, 4)
        chain = follower.chain()
        assert chain == read_chain(store, KEYS)
        assert (chain.master, chain.order, chain.layouts) == (None, ("relay-1", "relay-3"), frozenset({2}))
        for w in watches:
            w.cancel()
