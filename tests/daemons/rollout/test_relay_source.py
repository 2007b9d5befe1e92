"""RelayFollower in process: which relay a rollout reads from, the switch when its relay
dies or is replaced, back-off and one log line per kind of failure, and an engine thread
that keeps serving while a lookup hangs. A stand-in store (get_prefix over a dict) and
MemoryReader; the real daemon with etcd is test_relay_switch.py."""

from __future__ import annotations

import copy
import logging
import threading
import time

from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.members import RelayMember
from rlfleet.common.control.store import KeyValue, StoreUnavailable
from rlfleet.common.wire.sockets import RequestClient, RequestServer
from rlfleet.daemons.rollout.loop import EngineLoop
from rlfleet.daemons.rollout.relay_source import RelayFollower, choose_relay

from .test_engine import req
from .test_loop import MemoryReader, ModelSizedEngine, scaled_weights

JOB, HOST = "rs", "gpu-3"
KEYS = JobKeys(JOB)


def relay(rid: str, host: str = HOST, state: str = "running", shm_dir: str = "/dev/shm/x") -> RelayMember:
    return RelayMember(rid, host, "tcp://10.0.0.1:1", shm_dir, -1, state, 0.0)


def test_choose_stays_on_its_relay_while_registered_else_the_first_running_one():
    a, b, c = relay("relay-10"), relay("relay-2"), relay("relay-1", state="draining")
    elsewhere = relay("relay-0", host="gpu-4")
    assert choose_relay([a, b, c, elsewhere], HOST, None) == b  # running first, natural order
    assert choose_relay([a, b, c, elsewhere], HOST, "relay-10") == a  # no flapping to a "better" one
    assert choose_relay([a, c], HOST, "relay-2") == a  # its relay is gone: another of this host
    assert choose_relay([c, elsewhere], HOST, None) == c  # not running, but the only one here
    assert choose_relay([elsewhere, relay("relay-5", shm_dir="")], HOST, None) is None


class DictStore:
    """get_prefix over {relay id: registration}; `down` makes it raise like an unreachable etcd."""

    def __init__(self) -> None:
        self.relays: dict[str, dict] = {}
        self.down = False
        self.reads = 0

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        assert prefix == KEYS.role_members_prefix("relay")
        self.reads += 1
        if self.down:
            raise StoreUnavailable("etcd get_prefix: no endpoint answered (127.0.0.1:2379)")
        return [KeyValue(KEYS.member("relay", rid), {"id": rid, **v}, 1, 1) for rid, v in sorted(self.relays.items())]

    def watch_prefix(self, prefix: str, start_revision: int | None = None):
        raise StoreUnavailable("the stand-in has no watch: the follower looks every interval_s")


def register(store: DictStore, rid: str, shm_dir) -> None:
    store.relays[rid] = {"role": "relay", "host": HOST, "state": "running", "shm_dir": str(shm_dir),
                         "addresses": {"chunks": "tcp://127.0.0.1:1"}}


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_dead_relay_is_replaced_with_back_off_and_one_line_per_failure(tmp_path, caplog):
    caplog.set_level(logging.INFO, "rlfleet.rollout")
    store = DictStore()
    readers: dict[str, MemoryReader] = {}

    def make_reader(r: RelayMember) -> MemoryReader:
        readers[r.id] = MemoryReader()
        return readers[r.id]

    f = RelayFollower(store, JOB, HOST, make_reader, interval_s=1.0, max_backoff_s=8.0)  # type: ignore[arg-type]
    # No relay yet: the delay doubles up to the ceiling; one line says so.
    assert [f.look() for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert f.get(0.0) is None
    assert len(warnings_of(caplog)) == 1 and "no relay registered on host gpu-3" in warnings_of(caplog)[0]

    (tmp_path / "a").mkdir()
    register(store, "relay-a", tmp_path / "a")
    assert f.look() == 1.0
    assert f.get(0.0) is readers["relay-a"] and f.relay.id == "relay-a"
    assert list(f.events) == ["reading weights from relay relay-a, which holds no version yet"]
    f.events.clear()
    assert f.look() == 1.0 and f.get(0.0) is readers["relay-a"] and not f.events  # no new reader per look

    # relay-a dies (its lease expires; its store stays behind) and relay-b registers before
    # its store exists: keep reading relay-a's, retry with back-off, say it once.
    caplog.clear()
    del store.relays["relay-a"]
    register(store, "relay-b", tmp_path / "b")
    assert [f.look() for _ in range(3)] == [1.0, 2.0, 4.0]
    assert f.get(0.0) is readers["relay-a"]
    assert warnings_of(caplog) == [f"relay lookup: relay relay-b's store {tmp_path / 'b'} does not exist; "
                                   "still reading relay relay-a's store, retrying with back-off up to 8 s"]
    store.down = True  # another kind of failure: its own line, once
    assert [f.look() for _ in range(2)] == [8.0, 8.0]
    assert len(warnings_of(caplog)) == 2 and "no endpoint answered" in warnings_of(caplog)[1]

    store.down = False
    (tmp_path / "b").mkdir()
    readers_before = dict(readers)
    assert f.look() == 1.0
    assert f.get(0.0) is readers["relay-b"] and readers_before.keys() == {"relay-a"}
    assert list(f.events) == ["reading weights from relay relay-b (was relay-a), which holds no version yet"]
    assert "relay lookup works again after 5 failed look(s)" in caplog.text


def test_a_reader_that_fails_keeps_the_old_one(tmp_path, caplog):
    store = DictStore()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    register(store, "relay-a", tmp_path / "a")
    good = MemoryReader()

    def make_reader(r: RelayMember):
        if r.id == "relay-b":
            raise PermissionError(13, "Permission denied", r.shm_dir)
        return good

    f = RelayFollower(store, JOB, HOST, make_reader, interval_s=0.5)  # type: ignore[arg-type]
    assert f.look() == 0.5 and f.get(0.0) is good
    del store.relays["relay-a"]
    register(store, "relay-b", tmp_path / "b")
    assert [f.look() for _ in range(2)] == [0.5, 1.0]
    assert f.get(0.0) is good and f.relay.id == "relay-a"
    assert len(warnings_of(caplog)) == 1 and "reader for relay relay-b" in warnings_of(caplog)[0]


class HangingStore(DictStore):
    """A lookup that does not answer until the test says so (an etcd behind a partition)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.answer = threading.Event()

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        self.entered.set()
        assert self.answer.wait(30), "the test never let the lookup answer"
        return super().get_prefix(prefix)


def test_the_engine_thread_serves_while_the_relay_lookup_hangs(tiny_model, tmp_path):
    """The engine thread only takes the reader the follower holds: while the lookup hangs
    it answers requests under the version it has; once the lookup answers it loads the
    new relay's version."""
    model = copy.deepcopy(tiny_model)
    store = HangingStore()
    (tmp_path / "b").mkdir()
    register(store, "relay-b", tmp_path / "b")
    reader = MemoryReader()
    reader.versions[1] = scaled_weights(model, 2.0)
    follower = RelayFollower(store, JOB, HOST, lambda r: reader)  # type: ignore[arg-type,return-value]
    server = RequestServer("tcp://127.0.0.1:0")
    loop = EngineLoop(ModelSizedEngine(model, max_batch=4, max_len=256), server, "rollout-s", follower,
                      check_every_s=0.01)
    follower.start()
    loop.start()
    client = RequestClient(server.endpoint)
    try:
        assert store.entered.wait(10)
        for i in range(3):  # the lookup is still hanging: served at once, under version 0
            r = client.request(req(f"r{i}", [1, 5, 6], max_new=3), timeout_s=5)
            assert r.finish_reason == "length" and r.weight_version == 0
        assert not store.answer.is_set() and follower.get(0.0) is None
        store.answer.set()
        deadline, i, r = time.monotonic() + 20, 0, None
        while (r is None or r.weight_version != 1) and time.monotonic() < deadline:
            r = client.request(req(f"s{i}", [1, 5, 6], max_new=3), timeout_s=5)
            i += 1
        assert r is not None and r.weight_version == 1 and follower.relay.id == "relay-b"
    finally:
        store.answer.set()
        follower.stop()
        loop.stop()
        client.close()
        server.close()


class CountingStore:
    """A real EtcdStore whose get_prefix calls are counted."""

    def __init__(self, store) -> None:
        self.store, self.reads = store, 0

    def get_prefix(self, prefix: str):
        self.reads += 1
        return self.store.get_prefix(prefix)

    def watch_prefix(self, prefix: str, start_revision: int | None = None):
        return self.store.watch_prefix(prefix, start_revision)


def test_the_follower_waits_on_a_watch_and_wakes_only_for_its_hosts_relays(etcd, tmp_path):
    """It read members/relay/ once a second; now once, then again only when a relay of
    its host registers, changes its store or state, or goes. A relay's registration
    changes with every version: those puts (and other hosts' relays) wake nothing."""
    from rlfleet.common.control.etcd_store import EtcdStore
    from tests.integration.helpers import wait_for

    real = EtcdStore(etcd.endpoints)
    store = CountingStore(real)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()

    def put(rid: str, host: str, shm_dir, newest: int = 0) -> None:
        real.put(KEYS.member("relay", rid), {"role": "relay", "host": host, "state": "running",
                                             "shm_dir": str(shm_dir), "newest": newest,
                                             "addresses": {"chunks": "tcp://127.0.0.1:1"}})

    put("relay-a", HOST, tmp_path / "a")
    follower = RelayFollower(store, JOB, HOST, lambda r: MemoryReader())  # type: ignore[arg-type,return-value]
    follower.start()
    try:
        wait_for("the first look", lambda: follower.relay is not None and follower.relay.id == "relay-a", 10)
        reads = store.reads
        for version in range(1, 21):  # the relay's registration changes with each version
            put("relay-a", HOST, tmp_path / "a", newest=version)
        put("relay-z", "gpu-9", tmp_path / "b")  # another host's relay
        wait_for("the 21 events seen and let pass", lambda: follower.events_let_pass >= 21, 10)
        assert store.reads == reads, f"{store.reads - reads} looks for changes that do not matter"
        real.delete(KEYS.member("relay", "relay-a"))  # relay-a dies; relay-b takes this host over
        put("relay-b", HOST, tmp_path / "b")
        wait_for("the switch to relay-b", lambda: follower.relay.id == "relay-b", 10)
        assert store.reads - reads <= 3
    finally:
        follower.stop()
        real.close()
