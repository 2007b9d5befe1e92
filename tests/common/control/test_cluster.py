"""Typed etcd records (common/control/records.py, common/control/members.py) and the whole-job
snapshot (common/control/cluster.py): good values, malformed values, immutability, and
that keys are spelled and values parsed only in common/."""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path

import pytest

from rlfleet.common.control import records
from rlfleet.common.control.cluster import Cluster
from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import ROOT_PREFIX, JobKeys, job_of
from rlfleet.common.control.members import Leader, Member, Node, Placement, RelayMember, members_from, placements_from
from rlfleet.common.control.store import KeyValue

K = JobKeys("demo")
REPO = Path(__file__).resolve().parents[3]


def kv(key: str, value, lease_id: int = 0, mod_revision: int = 1) -> KeyValue:
    return KeyValue(key, value, 1, mod_revision, lease_id)


RELAY_VALUE = {"id": "relay-0", "role": "relay", "host": "h1", "pid": 42, "state": "running", "leader": False,
               "lease": "7", "addresses": {"chunks": "tcp://127.0.0.1:5000"}, "metrics": "http://m",
               "started": 100.5, "shm_dir": "/dev/shm/x", "transport": "tcp", "newest": 3, "newest_at": 101.0,
               "versions": [[3, 1], [2, 1]], "successor": "relay-1", "master": True}


# -- members ---------------------------------------------------------------------------
def test_member_parses_common_and_role_fields():
    m = Member.from_kv(K, kv(K.member("relay", "relay-0"), RELAY_VALUE, lease_id=7))
    assert (m.role, m.id, m.host, m.pid, m.state, m.lease_id, m.started) == \
        ("relay", "relay-0", "h1", 42, "running", 7, 100.5)
    assert m.address("chunks") == "tcp://127.0.0.1:5000" and m.address("requests") is None
    assert m.info["newest"] == 3 and m.info["versions"] == ((3, 1), (2, 1)) and m.problem == ""
    r = RelayMember.of(m)
    assert (r.address, r.shm_dir, r.newest, r.newest_at, r.versions, r.successor, r.master) == \
        ("tcp://127.0.0.1:5000", "/dev/shm/x", 3, 101.0, ((3, 1), (2, 1)), "relay-1", True)
    assert m.to_json()["versions"] == [[3, 1], [2, 1]] and "problem" not in m.to_json()


@pytest.mark.parametrize("value, problem", [
    ([1, 2], "expected a JSON object"),
    ("running", "expected a JSON object"),
    ({"pid": "42"}, "pid: expected an integer"),
    ({"pid": True}, "pid: expected an integer"),  # JSON true is not 1
    ({"addresses": ["tcp://x"]}, "addresses: expected an object"),
    ({"addresses": {"chunks": 5}}, "addresses.chunks: expected a string"),
    ({"leader": "yes"}, "leader: expected true or false"),
    ({"id": "relay-9"}, "id: 'relay-9' differs from the key"),
    ({"newest": "3"}, "newest: expected int"),  # a relay role field with the wrong type
])
def test_a_malformed_member_is_a_record_with_a_problem_never_an_exception(value, problem):
    m = Member.from_kv(K, kv(K.member("relay", "relay-0"), value))
    assert m.id == "relay-0" and problem in m.problem and m.problem.startswith("members/relay/relay-0")
    r = RelayMember.of(m)  # the typed relay view still works, with defaults
    assert r.newest == -1 or r.newest == 3


def test_a_member_with_a_bad_field_keeps_the_fields_that_parsed():
    m = Member.parse("rollout", "rollout-0", {"pid": "x", "addresses": {"requests": "tcp://r"}, "state": "running"})
    assert m.address("requests") == "tcp://r" and m.running and "pid" in m.problem


def test_members_from_skips_keys_that_name_no_member():
    kvs = [kv(K.member("rollout", "r-0"), {"state": "running"}), kv(K.members_prefix + "rollout/r-1/extra", {}),
           kv(K.member("trainer", "t-0"), None)]
    assert [(m.role, m.id) for m in members_from(K, kvs)] == [("rollout", "r-0"), ("trainer", "t-0")]


def test_leader_node_placement():
    lead = Leader.from_kv(K, kv(K.leader("trainer"), {"id": "trainer-0", "since": 5}, lease_id=3))
    assert (lead.role, lead.id, lead.since, lead.lease_id, lead.problem) == ("trainer", "trainer-0", 5.0, 3, "")
    assert "id: missing" in Leader.from_kv(K, kv(K.leader("trainer"), {"since": 5})).problem
    inv = {"host": "h1", "cpus_logical": 8, "cpus_physical": 4, "memory_bytes": 2**34, "memory_available_bytes": 2**33,
           "gpus": [{"index": 0, "name": "H100", "memory_bytes": 2**36}], "boot_time": 1.0, "seen": 2.0,
           "labels": {"cpu": "x86"}, "agent": {"pid": 9, "backend": "systemd"},
           "daemons": {"rollout-0": {"role": "rollout", "state": "waiting", "restarts": 5,
                                     "last_exit": "exit code 1", "failing": True}}}
    node = Node.from_kv(K, kv(K.node("h1"), inv))
    assert node.gpus[0].name == "H100" and node.to_value() == inv and node.problem == ""
    assert [d.id for d in node.failing] == ["rollout-0"] and node.labels == {"cpu": "x86"}
    odd = Node.from_kv(K, kv(K.node("h1"), {"daemons": {"relay-0": {"failing": "yes"}}, "labels": {"a": 1}}))
    assert "daemons.relay-0.failing" in odd.problem and "labels.a" in odd.problem and odd.failing == ()
    bad = Node.from_kv(K, kv(K.node("h1"), {"gpus": [{"name": 7}], "cpus_logical": "8"}))
    assert "gpus[0].name" in bad.problem and "cpus_logical" in bad.problem and bad.cpus_logical == 0
    placed = Placement.from_kv(K, kv(K.placement("h1", "relay", "relay-0"),
                                     {"host": "h1", "role": "relay", "id": "relay-0"}))
    assert placed == Placement("h1", "relay", "relay-0") and placed.to_value()["id"] == "relay-0"
    timed = Placement.from_kv(K, kv(K.placement("h1", "relay", "relay-0"),
                                    {"host": "h1", "role": "relay", "id": "relay-0", "since": 12.5}))
    assert timed == placed and timed.since == 12.5 and timed.problem == "" and timed.to_value()["since"] == 12.5
    assert "does not repeat" in Placement.from_kv(K, kv(K.placement("h1", "relay", "relay-0"), {
        "host": "h1", "role": "relay", "id": "relay-0", "since": "soon"})).problem
    gpus = Placement.from_kv(K, kv(K.placement("h1", "relay", "relay-0"),
                                   {"host": "h1", "role": "relay", "id": "relay-0", "gpus": [0, 1]}))
    assert gpus.gpus == (0, 1) and gpus != placed and gpus.to_value()["gpus"] == [0, 1] and placed.gpus is None
    assert "not a list of GPU indices" in Placement.from_kv(K, kv(K.placement("h1", "relay", "relay-0"), {
        "host": "h1", "role": "relay", "id": "relay-0", "gpus": [-1]})).problem
    odd = Placement.from_kv(K, kv(K.placement("h1", "relay", "relay-0"), {"host": "h2"}))
    assert odd != placed and "does not repeat the key" in odd.problem and odd.host == "h1"
    # A key with a component too many names no daemon: skipped, the others kept.
    extra = kv(K.placement_prefix + "h1/relay/relay-0/x", {})
    assert placements_from(K, [kv(K.placement("h1", "relay", "relay-0"), placed.to_value()), extra]) == [placed]


# -- single-key records -----------------------------------------------------------------
@pytest.mark.parametrize("record, good, expect, bad, problem", [
    (records.WeightsLatest, {"version": 4, "bytes": 10, "checksum": "c", "master": "relay-0"},
     {"version": 4, "master": "relay-0"}, {"version": "4"}, "weights/latest.version: expected an integer"),
    (records.RelayChain, {"master": "relay-0", "order": ["relay-0", "relay-1"], "layouts": [2], "updated": 1.5},
     {"order": ("relay-0", "relay-1"), "layouts": (2,)}, {"order": "relay-0"}, "relay/chain.order: expected a list"),
    (records.RelayMaster, {"id": "relay-0", "since": 1.0, "newest": 7}, {"id": "relay-0", "newest": 7},
     {"id": 0}, "relay/master.id: expected a string"),
    (records.TrainerProgress,
     {"version": 3, "consumed_groups": 9, "trained_groups": 8, "dropped_groups": 1, "time": 2.0},
     {"consumed_groups": 9, "trained_groups": 8}, {"consumed_groups": "9"}, "consumed_groups: expected an integer"),
    (records.Checkpoint, {"version": 5, "path": "/c/step-5", "step": 5, "time": 1.0},
     {"version": 5, "path": "/c/step-5"}, {"version": 5}, "trainer/checkpoint.path: missing"),
    (records.PromptCursor, {"next": 8, "claims": {"env-host-0": [[0, 8]]}},
     {"next": 8, "claims": {"env-host-0": ((0, 8),)}}, {"next": 8, "claims": {"env-host-0": [[0, 9]]}},
     "prompts/cursor.claims.env-host-0"),
])
def test_single_key_records_parse_good_and_report_malformed(record, good, expect, bad, problem):
    rec = record.from_kv(kv(getattr(K, record.KEY), good))
    assert rec.problem == ""
    got = {name: getattr(rec, name) for name in expect}
    assert {n: dict(v) if isinstance(v, Mapping) else v for n, v in got.items()} == expect
    if hasattr(rec, "to_value"):  # what a writer puts is what a reader gets back
        as_parsed = dataclasses.replace(rec, mod_revision=0) if hasattr(rec, "mod_revision") else rec
        assert record.parse(rec.to_value()) == as_parsed
    for malformed in (bad, None, [good], "text"):
        got = record.from_kv(kv(getattr(K, record.KEY), malformed))
        assert got.problem, f"{record.__name__} accepted {malformed!r}"
    assert problem in record.from_kv(kv(getattr(K, record.KEY), bad)).problem


def test_progress_never_counts_more_than_an_honest_value():
    assert records.TrainerProgress.parse({"consumed_groups": -5}).consumed_groups == 0
    assert records.TrainerProgress.parse({"consumed_groups": "7"}).consumed_groups == 0


def test_relay_master_and_cursor_carry_what_a_compare_and_swap_needs():
    m = records.RelayMaster.from_kv(kv(K.relay_master, {"id": "relay-0", "newest": None}, lease_id=9, mod_revision=12))
    assert (m.newest, m.lease_id, m.mod_revision) == (None, 9, 12)
    c = records.PromptCursor.from_kv(kv(K.prompts_cursor, {"next": 3, "claims": {"a": [[0, 3]]}}, mod_revision=4))
    assert c.mod_revision == 4 and c.to_value() == {"next": 3, "claims": {"a": [[0, 3]]}}
    req = records.RelayLayoutRequest.from_kv(K, kv(K.relay_layout(2), {"layout": 2, "requested_by": "h", "at": 1.0}))
    assert req.layout == 2 and "layout: missing" in records.RelayLayoutRequest.parse({}).problem


def test_records_are_immutable():
    m = Member.parse("relay", "relay-0", RELAY_VALUE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.state = "draining"  # type: ignore[misc]
    with pytest.raises(TypeError):
        m.addresses["chunks"] = "tcp://elsewhere"  # type: ignore[index]
    with pytest.raises(TypeError):
        m.info["newest"] = 4  # type: ignore[index]
    c = records.PromptCursor.parse({"next": 2, "claims": {"a": [[0, 2]]}})
    with pytest.raises(TypeError):
        c.claims["b"] = ()  # type: ignore[index]
    cluster = Cluster.from_kvs(K, [kv(K.leader("trainer"), {"id": "t"})])
    with pytest.raises(TypeError):
        cluster.leaders["relay"] = Leader("relay")  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cluster.weights = records.WeightsLatest(3)  # type: ignore[misc]


# -- the whole job ----------------------------------------------------------------------
def test_cluster_sorts_every_key_into_its_record_and_lists_what_is_malformed():
    kvs = [kv(K.spec, {"job": {"name": "demo"}}),
           kv(K.member("trainer", "trainer-0"), {"state": "running", "leader": True, "training": "done"}),
           kv(K.member("rollout", "rollout-1"), {"state": "running", "addresses": {"requests": "tcp://r1"}}),
           kv(K.member("rollout", "rollout-0"), {"state": "running", "pid": "nope"}),
           kv(K.members_prefix + "rollout/x/y", {}),
           kv(K.leader("trainer"), {"id": "trainer-0", "since": 1}),
           kv(K.node("h1"), {"cpus_logical": 4}),
           kv(K.placement("h1", "trainer", "trainer-0"), {"host": "h1", "role": "trainer", "id": "trainer-0"}),
           kv(K.weights_latest, {"version": 12}),
           kv(K.relay_master, {"id": "relay-0", "newest": 12}),
           kv(K.relay_chain, {"master": "relay-0", "order": ["relay-0"]}),
           kv(K.relay_layout(2), {"layout": 2}),
           kv(K.trainer_progress, {"consumed_groups": 6}),
           kv(K.trainer_checkpoint, {"version": 10, "path": "/c"}),
           kv(K.prompts_cursor, {"next": "many"}),
           kv(K.prefix + "owner", {"by": "someone"})]  # a key this version does not read: ignored
    c = Cluster.from_kvs(K, kvs, taken_at=5.0)
    assert [m.id for m in c.members("rollout")] == ["rollout-0", "rollout-1"]
    assert [m.role for m in c.members()] == ["rollout", "rollout", "trainer"]
    assert c.leader("trainer").id == "trainer-0" and c.leader("relay") is None
    assert c.leader_member("trainer").info["training"] == "done"
    assert c.member("rollout", "rollout-1").address("requests") == "tcp://r1"
    assert c.nodes["h1"].cpus_logical == 4 and c.placement[0].id == "trainer-0"
    assert (c.weights.version, c.relay_master.newest, c.relay_chain.order) == (12, 12, ("relay-0",))
    assert c.relay_layouts[0].layout == 2 and c.progress.consumed_groups == 6 and c.checkpoint.version == 10
    assert c.has_spec and c.taken_at == 5.0
    assert len(c.problems) == 3, c.problems
    assert any("rollout-0.pid" in p for p in c.problems)
    assert any(p.startswith("skipped /rlfleet/demo/members/rollout/x/y") for p in c.problems)
    assert any("prompts/cursor.next" in p for p in c.problems)


def test_cluster_read_from_a_real_etcd_and_the_status_snapshot_reports_malformed_values(etcd):
    from rlfleet.tools.ctl.fleet_view import take_snapshot

    store = EtcdStore(etcd.endpoints)
    lease = store.grant_lease(30)
    store.put(K.member("rollout", "rollout-0"), {"id": "rollout-0", "host": "h1", "state": "running",
                                                 "pid": 7, "addresses": {"requests": "tcp://x"}}, lease=lease)
    store.put(K.member("relay", "relay-0"), "garbage", lease=lease)
    store.put(K.leader("repack-manager"), ["not", "an", "object"], lease=lease)
    store.put(K.node("h1"), {"cpus_logical": 2, "gpus": []})
    store.put(JobKeys("other").spec, {})
    c = Cluster.read(store, "demo")
    assert c.member("rollout", "rollout-0").lease_id == lease.id
    assert c.member("relay", "relay-0").problem == "members/relay/relay-0: expected a JSON object, got 'garbage'"
    snap = take_snapshot(store, "demo")  # the status view: problems listed, no traceback
    assert [m.member_id for m in snap.members] == ["relay-0", "rollout-0"]
    assert snap.leaders == {"repack-manager": "?"} and snap.nodes["h1"]["cpus_logical"] == 2
    assert any("members/relay/relay-0: expected a JSON object" in p for p in snap.problems)
    assert any("leader/repack-manager: expected a JSON object" in p for p in snap.problems)
    assert snap.to_json()["members"][1]["addresses"] == {"requests": "tcp://x"}
    assert sorted({job_of(kv.key) for kv in store.get_prefix(ROOT_PREFIX)}) == ["demo", "other"]
    store.close()


def test_job_of():
    assert job_of(K.member("relay", "r")) == "demo" and job_of(K.spec) == "demo"
    assert job_of("/other/demo/spec") is None and job_of(ROOT_PREFIX + "demo") is None


# -- keys spelled and values parsed only in common/ ------------------------------------
SOURCE_DIRS = ("common", "daemons", "relay", "tools")
PARSERS = {"common/control/keys.py", "common/control/records.py", "common/control/members.py", "common/control/cluster.py",
           "common/control/operations.py", "common/control/store.py", "common/control/etcd_store.py",
           "common/control/job_snapshot.py"}  # snapshot/restore copy raw values on purpose


def _sources():
    for d in SOURCE_DIRS:
        for path in sorted((REPO / d).rglob("*.py")):
            yield path.relative_to(REPO).as_posix(), path.read_text()


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


FILESYSTEM_ROOTS = ("/dev/shm/", "/opt/", "/etc/", "/var/lib/")


def test_keys_are_spelled_only_in_common_keys():
    """No string literal outside keys.py (docstrings and comments aside) holds the key
    root or a key path of a job; f-strings' literal parts count too."""
    key_like = re.compile(r"/rlfleet(/|$)|^(members|leader|nodes|placement|relay|weights|trainer|prompts)/")
    found = []
    for rel, text in _sources():
        if rel == "common/control/keys.py":
            continue
        tree = ast.parse(text)
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                # Filesystem paths on a host (/opt/rlfleet/venv, /etc/rlfleet/jobs) are no keys.
                if key_like.search(node.value) and not node.value.startswith(FILESYSTEM_ROOTS):
                    found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not found, "etcd keys spelled outside common/control/keys.py:\n" + "\n".join(found)


def test_values_are_parsed_only_in_common():
    """A raw etcd value (`kv.value`, a watch `event.value`) outside the record modules
    may only be handed straight to a record's `parse` (how watch events are read);
    `rlfleet keys` prints raw values on purpose (it is the raw key tree)."""
    raw = re.compile(r"\b\w*(kv|event|ev)\.value\b")
    found = []
    for rel, text in _sources():
        if rel in PARSERS:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            for match in raw.finditer(code):
                if code[:match.start()].endswith(".parse("):
                    continue
                if rel == "tools/cli.py" and "json.dumps(kv.value, sort_keys=True)" in code:
                    continue
                found.append(f"{rel}:{lineno}: {line.strip()}")
    assert not found, ("raw etcd values read outside common/ (use a record from common/control/records.py "
                       "or common/control/members.py):\n" + "\n".join(found))
