"""The Router with a policy that waits (queue scheduling, affinity): real sockets to fake
rollouts. A turn that finds every slot full is held in the env-host, sent when a request
finishes, and its turn timeout starts only then."""

from __future__ import annotations

import asyncio
import random
import threading
import time

from rlfleet.common.wire.arrays import Float32Array, Int32Array
from rlfleet.common.wire.messages import GenerateRequest, GenerateResult
from rlfleet.daemons.env_host.affinity import Affinity
from rlfleet.daemons.env_host.routing import Router
from rlfleet.daemons.env_host.routing_policy import LeastLoaded, RolloutTraits

from .fakes import FakeRollout


def _held(release: threading.Event):
    """Answers each request once `release` is set (a rollout busy with it until then)."""
    def reply(srv, req: GenerateRequest) -> GenerateResult:
        release.wait(10)
        return GenerateResult(req.request_id, Int32Array([5]), Float32Array([-0.5]), 0, "stop")
    return reply


def _req(tid: str) -> GenerateRequest:
    return GenerateRequest(f"{tid}-t0", tid, Int32Array([1, 2, 3]), 4, 1.0, 1.0)


def test_a_turn_waits_for_a_free_slot_and_its_timeout_starts_when_sent():
    release = threading.Event()
    fakes = [FakeRollout(_held(release), name=f"r{i}") for i in range(2)]

    async def main() -> list[str]:
        policy = LeastLoaded(random.Random(0), queue=True)
        policy.set_fleet({"r0": RolloutTraits("h", 1), "r1": RolloutTraits("h", 1)})
        router = Router(policy=policy)
        router.update({"r0": fakes[0].address, "r1": fakes[1].address})
        try:
            # Two fill both slots; the third is held here, not queued in a rollout.
            calls = [asyncio.create_task(router.generate(_req(f"p{i}-g0"), timeout))
                     for i, timeout in enumerate((10.0, 10.0, 1.0))]
            deadline = time.monotonic() + 5
            while sum(len(f.requests) for f in fakes) < 2:
                assert time.monotonic() < deadline, "the first two requests were not sent within 5 s"
                await asyncio.sleep(0.01)
            await asyncio.sleep(1.2)  # longer than the held turn's own 1 s timeout
            assert sum(len(f.requests) for f in fakes) == 2, "a third request was sent to a full rollout"
            assert router.load() == {"r0": 1, "r1": 1}
            release.set()  # the first two finish; the held one goes out and succeeds in time
            return [rid for rid, _ in await asyncio.gather(*calls)]
        finally:
            router.close()

    try:
        chosen = asyncio.run(main())
    finally:
        release.set()
        for f in fakes:
            f.close()
    assert sorted(chosen[:2]) == ["r0", "r1"] and chosen[2] in ("r0", "r1")
    assert sum(len(f.requests) for f in fakes) == 3


def test_affinity_routes_tags_to_their_hardware_through_the_router():
    release = threading.Event()
    release.set()
    fakes = [FakeRollout(_held(release), name=f"r{i}") for i in range(2)]

    async def main() -> dict[str, list[str]]:
        policy = Affinity({"prefill": "h800", "decode": "h20"}, rng=random.Random(0))
        policy.set_fleet({"fast": RolloutTraits("h800", 8), "cheap": RolloutTraits("h20", 8)})
        router = Router(policy=policy)
        router.update({"fast": fakes[0].address, "cheap": fakes[1].address})
        try:
            got: dict[str, list[str]] = {"prefill": [], "decode": []}
            for i in range(6):
                tag = ("prefill", "decode")[i % 2]
                rid, _ = await router.generate(_req(f"p{i}-g0"), 5.0, tag=tag)
                got[tag].append(rid)
            return got
        finally:
            router.close()

    try:
        got = asyncio.run(main())
    finally:
        for f in fakes:
            f.close()
    assert got == {"prefill": ["fast"] * 3, "decode": ["cheap"] * 3}
