"""Reward dispatch order alone (no workers): first come, first served."""

from __future__ import annotations

from rlfleet.daemons.reward_host.dispatch import FifoQueue


def test_fifo_order_and_put_back_goes_first():
    q = FifoQueue()
    for job in ("a", "b", "c"):
        q.push(job)
    assert len(q) == 3 and q.pop() == "a"
    q.put_back("a")  # the worker it went to had died
    assert [q.pop() for _ in range(len(q))] == ["a", "b", "c"]
    assert len(q) == 0
