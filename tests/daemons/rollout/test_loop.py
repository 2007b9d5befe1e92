"""EngineLoop in process over real ZeroMQ sockets: ADD/ABORT/stats between steps and the
weight-version policy, with an in-memory stand-in for the relay's WeightReader."""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest

from rlfleet.common.wire.messages import Abort, GenerateRequest, GenerateResult, RolloutStats
from rlfleet.common.wire.sockets import RequestClient, RequestServer
from rlfleet.daemons.rollout.engines.torch_engine import TorchEngine
from rlfleet.daemons.rollout.loop import EngineLoop
from tests.integration.helpers import wait_for

from .test_engine import greedy_reference, req


class MemoryReader:
    """The WeightReader interface over a dict of versions (the relay is another issue)."""

    def __init__(self) -> None:
        self.versions: dict[int, dict[str, np.ndarray]] = {}
        self.opened: list[int] = []

    def get(self, now: float) -> MemoryReader:  # its own ReaderSource: the relay never changes
        return self

    def newest(self) -> int | None:
        return max(self.versions) if self.versions else None

    @contextmanager
    def open(self, version: int | None = None):
        v = self.newest() if version is None else version
        self.opened.append(v)
        yield SimpleNamespace(version=v, tensors=self.versions[v])


class ModelSizedEngine(TorchEngine):
    """Steps of at least 2 ms, as a real model's: the tiny model's lean forward runs 250
    tokens in well under 0.1 s, faster than these tests can act on a running request
    (abort it, hold another behind it), and the tiny model's context ends at 256."""

    def step(self):
        done_at = time.monotonic() + 0.002
        out = super().step()
        while time.monotonic() < done_at:
            time.sleep(0.0005)
        return out


@pytest.fixture
def served(tiny_model):
    """(loop, client, reader, model): a running EngineLoop on loopback and a client of it."""
    model = copy.deepcopy(tiny_model)  # weights get replaced
    reader = MemoryReader()
    server = RequestServer("tcp://127.0.0.1:0", expect=(GenerateRequest, Abort, RolloutStats))
    loop = EngineLoop(ModelSizedEngine(model, max_batch=4, max_len=256), server, "rollout-t",
                      reader, hold_max_s=30.0, check_every_s=0.01)
    loop.start()
    client = RequestClient(server.endpoint)
    yield loop, client, reader, model
    loop.stop()
    assert loop.error is None
    client.close()
    server.close()


def scaled_weights(model, factor: float) -> dict[str, np.ndarray]:
    return {k: (v.detach().numpy() * factor).astype(np.float32) for k, v in model.state_dict().items()}


def collect(client: RequestClient, rids: list[str], timeout_s: float = 20.0) -> dict[str, GenerateResult]:
    got: dict[str, GenerateResult] = {}
    deadline = time.monotonic() + timeout_s
    while set(rids) - set(got) and time.monotonic() < deadline:
        for rid, msg in client.poll_replies(0.1):
            got[rid] = msg
    assert set(rids) <= set(got), f"no reply for {set(rids) - set(got)}"
    return got


def stats(client: RequestClient) -> RolloutStats:
    empty = RolloutStats.poll()
    return client.request(empty, timeout_s=5)


def wait_seen(loop: EngineLoop, version: int) -> None:
    """Until the loop's weight policy has seen ``version`` on its relay."""
    wait_for(f"the loop seeing weight version {version}", lambda: loop.policy.newest == version,
             timeout_s=10.0, every_s=0.002)


def wait_stats(client: RequestClient, pred, timeout_s: float = 10.0) -> RolloutStats:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = stats(client)
        if pred(s):
            return s
        time.sleep(0.002)
    raise AssertionError(f"stats never matched; last {s}")


def test_generate_abort_and_stats_over_the_socket(served, tiny_model):
    loop, client, _, _ = served
    p = [1, 5, 9, 12, 7]
    r = client.request(req("g", p, max_new=12), timeout_s=10)
    assert r.request_id == "g" and r.weight_version == 0
    assert r.token_ids.tolist() == greedy_reference(tiny_model, p, 12)

    long_rid = client.send(req("long", p, max_new=240))
    s = wait_stats(client, lambda s: s.running == 1)
    assert s.rollout_id == "rollout-t" and s.kv_total == 4 * 256 and s.kv_used >= len(p)
    aborted = client.request(Abort("long"), timeout_s=5)
    original = collect(client, [long_rid])[long_rid]
    assert aborted.finish_reason == original.finish_reason == "abort"
    assert aborted.token_ids == original.token_ids and 0 < len(original.token_ids) < 240
    unknown = client.request(Abort("nope"), timeout_s=5)
    assert unknown.finish_reason == "abort" and "not waiting or running" in unknown.error
    assert stats(client).running == 0


def test_malformed_requests_are_errors_and_the_engine_serves_on(served):
    _, client, _, _ = served
    bad = [req("empty", []), req("long", [1] * 250, max_new=10), req("hot", [1, 5], temperature=-1.0)]
    rids = [client.send(m) for m in bad]
    good = client.send(req("ok", [1, 5, 6], max_new=3))
    got = collect(client, rids + [good])
    errors = [got[rid].error for rid in rids]
    assert [got[rid].finish_reason for rid in rids] == ["error"] * 3
    assert errors[0] == "prompt_token_ids is empty"
    assert errors[1] == "prompt of 250 tokens + max_new_tokens 10 exceeds the cache length 256"
    assert errors[2].startswith("temperature must be finite and >= 0")
    assert got[good].finish_reason == "length" and len(got[good].token_ids) == 3


def test_new_version_loads_between_requests_and_new_ones_wait_for_it(served, tiny_model):
    loop, client, reader, model = served
    p = [1, 8, 8, 9]
    a = client.send(req("a", p, max_new=200))
    wait_stats(client, lambda s: s.running == 1)
    reader.versions[1] = scaled_weights(tiny_model, 1.5)
    wait_seen(loop, 1)  # before "b" arrives, so "b" waits for it
    b = client.send(req("b", p, max_new=5))
    wait_stats(client, lambda s: s.waiting == 1 or s.weight_version == 1)
    got = collect(client, [a, b])
    assert got[a].weight_version == 0 and len(got[a].token_ids) == 200  # never split
    assert got[a].token_ids.tolist() == greedy_reference(tiny_model, p, 200)
    assert got[b].weight_version == 1
    assert got[b].token_ids.tolist() == greedy_reference(model, p, 5)  # model now holds v1
    assert any("loaded weight version 1 (was 0)" in e for e in loop.events)


def test_release_ends_running_requests_and_loads_at_once(served):
    loop, client, reader, model = served
    a = client.send(req("a", [1, 4, 4], max_new=240))
    wait_stats(client, lambda s: s.running == 1)
    reader.versions[3] = scaled_weights(model, 0.5)
    loop.release()
    got = collect(client, [a])[a]
    assert got.finish_reason == "abort" and got.weight_version == 0
    assert 0 < len(got.token_ids) < 240
    assert wait_stats(client, lambda s: s.weight_version == 3).running == 0


def test_a_held_request_is_admitted_after_hold_max_s(tiny_model):
    model = copy.deepcopy(tiny_model)
    reader = MemoryReader()
    server = RequestServer("tcp://127.0.0.1:0")
    loop = EngineLoop(ModelSizedEngine(model, max_batch=4, max_len=256), server, "rollout-h",
                      reader, hold_max_s=0.05, check_every_s=0.01)
    loop.start()
    client = RequestClient(server.endpoint)
    try:
        a = client.send(req("a", [1, 4], max_new=250))
        wait_stats(client, lambda s: s.running == 1)
        reader.versions[1] = scaled_weights(model, 2.0)
        wait_seen(loop, 1)  # b will be held for it
        t0 = time.monotonic()
        b = client.request(req("b", [1, 4], max_new=2), timeout_s=10)
        waited = time.monotonic() - t0
        assert b.weight_version == 0 and waited >= 0.05  # held, then served by the old version
        got = collect(client, [a])[a]
        assert got.weight_version == 0 and len(got.token_ids) == 250
        assert wait_stats(client, lambda s: s.weight_version == 1)  # loaded once idle
    finally:
        loop.stop()
        client.close()
        server.close()


def test_a_version_that_fails_to_load_is_skipped(served):
    loop, client, reader, model = served
    broken = scaled_weights(model, 1.0)
    broken["model.norm.weight"] = np.zeros(7, np.float32)
    reader.versions[2] = broken
    deadline = time.monotonic() + 5
    while not any("refused" in e for e in loop.events) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert any("weight version 2 refused" in e and "model.norm.weight" in e for e in loop.events)
    r = client.request(req("x", [1, 6], max_new=3), timeout_s=5)  # not held for a bad version
    assert r.weight_version == 0 and r.finish_reason == "length"
    assert reader.opened == [2]  # tried once, not in a loop


def test_stop_drains_running_requests(served):
    loop, client, _, _ = served
    a = client.send(req("a", [1, 5], max_new=30))
    wait_stats(client, lambda s: s.running == 1)
    loop.stop()
    got = collect(client, [a])[a]
    assert got.finish_reason == "length" and len(got.token_ids) == 30  # finished within the drain time
    assert not loop.alive and loop.error is None
