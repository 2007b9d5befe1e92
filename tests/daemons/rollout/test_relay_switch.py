"""The real rollout daemon while the relay it reads weights from dies and another relay
takes its place on the same host (relay_source.py): the rollout is never declared dead
(its member key keeps its lease), its main loop keeps cycling and it keeps serving while
the switch waits for the new relay, and it ends up loading the new relay's version.

The old relay leaves its store behind, as a killed relay does; the new one registers
before its store exists, which holds the switch in progress for as long as the test
wants, and it serves chunks on a port that accepts connections and never answers: a
rollout reads a relay's shared memory and never dials it."""

from __future__ import annotations

import copy
import re
import socket
import urllib.request

import torch

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.store import Lease
from rlfleet.common.spec.job import load_spec
from rlfleet.common.wire.sockets import RequestClient
from tests.integration.helpers import rlfleet, stop, wait_for, write_spec

from .test_daemon_process import fill_store
from .test_engine import greedy_reference, req

JOB, HOST = "rswitch", "gpu-09"
KEYS = JobKeys(JOB)
SPEC = '[rollout.engine]\nkind = "torch"\nmax_batch = 8\n'


def scaled(model, factor: float):
    """(model, its tensors as a relay holds them) with every weight times `factor`."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.mul_(factor)
    return out, {k: v.detach().numpy() for k, v in out.state_dict().items() if k != "lm_head.weight"}


def register_relay(store: EtcdStore, rid: str, shm_dir, chunks: str) -> Lease:
    """A relay's member key, bound to its own lease as a relay daemon writes it."""
    lease = store.grant_lease(30)
    store.put(KEYS.member("relay", rid), {"id": rid, "role": "relay", "host": HOST, "state": "running",
                                          "shm_dir": str(shm_dir), "addresses": {"chunks": chunks}},
              lease=lease)
    return lease


def cycles(metrics_url: str) -> int:
    text = urllib.request.urlopen(metrics_url, timeout=2).read().decode()
    return int(float(re.search(r"^rlfleet_cycles_total\{[^}]*\} (\S+)$", text, re.M).group(1)))


def test_the_rollout_follows_a_replaced_relay_without_losing_its_lease(tmp_path, etcd, tiny_model_dir,
                                                                       tiny_model, monkeypatch):
    spec = load_spec(write_spec(tmp_path, JOB, SPEC, model=tiny_model_dir))  # lease_ttl_s = 2
    ttl_s, refresh_s = spec.etcd.lease_ttl_s, spec.etcd.refresh_interval_s
    store = EtcdStore(etcd.endpoints)
    store.put(KEYS.spec, spec.to_dict())
    monkeypatch.setenv("RLFLEET_TORCH_THREADS", "1")
    log = tmp_path / "rollout.log"
    proc = rlfleet("daemon", "rollout", "--job", JOB, "--etcd", etcd.endpoints_arg, "--id", "rollout-0",
                   "--host", HOST, log=log)
    key = KEYS.member("rollout", "rollout-0")
    black_hole = socket.create_server(("127.0.0.1", 0), backlog=16)  # accepts, never answers
    chunks = f"tcp://127.0.0.1:{black_hole.getsockname()[1]}"
    stores = []
    client = None
    try:
        def registered():
            kv = store.get(key)
            assert proc.poll() is None, log.read_text()[-3000:]
            return kv.value if kv and kv.value.get("addresses", {}).get("requests") else None

        member = wait_for("rollout-0 registered with a requests address", registered, timeout_s=90)
        lease = member["lease"]
        lost: list[str] = []

        def alive() -> bool:
            """The rollout's registration as its peers see it, checked at every poll."""
            kv = store.get(key)
            if proc.poll() is not None:
                lost.append(f"the rollout exited with {proc.returncode}")
            elif kv is None:
                lost.append("the rollout's member key is gone (declared dead)")
            elif kv.value.get("lease") != lease:
                lost.append(f"the rollout re-registered under lease {kv.value.get('lease')} (was {lease})")
            return not lost

        v1_model, v1 = scaled(tiny_model, 1.5)
        v2_model, v2 = scaled(tiny_model, 2.0)
        stores.append(fill_store(tmp_path / "relay-a", 1, v1))
        relay_a = register_relay(store, "relay-a", tmp_path / "relay-a", chunks)
        wait_for("weight version 1 from relay-a",
                 lambda: alive() and store.get(key).value["weight_version"] == 1, timeout_s=30)
        assert not lost, lost

        # relay-a is killed: its lease ends, its store stays behind. relay-b registers on
        # the same host before its store exists: the rollout cannot switch yet.
        store.revoke_lease(relay_a)
        register_relay(store, "relay-b", tmp_path / "relay-b", chunks)
        wait_for("the rollout trying relay-b (its store not there yet)",
                 lambda: alive() and "relay relay-b's store" in log.read_text(), timeout_s=20)
        # Meanwhile the main loop keeps cycling for more than two lease TTLs and serving.
        start = cycles(member["metrics"])
        enough = int(2 * ttl_s / refresh_s) + 1
        wait_for(f"{enough} more cycles while relay-b's store is missing",
                 lambda: alive() and cycles(member["metrics"]) >= start + enough, timeout_s=10 * ttl_s)
        client = RequestClient(member["addresses"]["requests"])
        r = client.request(req("during", [1, 5, 6, 7], max_new=5), timeout_s=10)
        assert r.weight_version == 1 and r.token_ids.tolist() == greedy_reference(v1_model, [1, 5, 6, 7], 5)
        assert not lost, lost

        # relay-b's store gets its first version: the rollout switches and loads it.
        stores.append(fill_store(tmp_path / "relay-b", 2, v2))
        wait_for("weight version 2 from relay-b", lambda: alive() and (
            (v := store.get(key).value)["weight_version"] == 2 and v.get("relay") == "relay-b"), timeout_s=30)
        r = client.request(req("after", [1, 5, 6, 7], max_new=5), timeout_s=10)
        assert r.weight_version == 2 and r.token_ids.tolist() == greedy_reference(v2_model, [1, 5, 6, 7], 5)
        assert alive(), lost
        text = log.read_text()
        assert text.count("relay relay-b's store") == 1, "one line for the whole wait, not one per retry"
        assert "reading weights from relay relay-b (was relay-a)" in text
    finally:
        if client is not None:
            client.close()
        stop(proc)
        black_hole.close()
        for s in stores:
            s.close()
