"""The user_code reward backend: reward functions from the spec, run in the sandbox.

Real sandboxed children: each hostile reward function ends as that trajectory's
outcome with the sandbox's reason, and the backend goes on scoring the next one."""

from __future__ import annotations

import os
import select
import time

import pytest
from pydantic import ValidationError

from rlfleet.common.wire.messages import Prompt
from rlfleet.daemons.reward_host.user_code import UserCode, UserCodeConfig, harness, parse_result
from rlfleet.daemons.reward_host.workers import RewardJob

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root "
                                "(namespaces, setuid): see docs/operations/sandbox.md")

EXACT = """
def reward(question, answer, completions):
    return 1.0 if completions[-1].strip() == answer else 0.0
"""


def job(key: str, completion: str, answer: str = "122") -> RewardJob:
    prompt = Prompt("arithmetic", "train", f"u-{key}", "37+85", answer)
    return RewardJob(key, "arithmetic", {}, prompt, [completion])


def config(source: str = EXACT, **kw) -> UserCodeConfig:
    return UserCodeConfig(source=source, **{"timeout_s": 3.0, "cpu_s": 1, "memory_mib": 128,
                                            "nproc": 8, "tmp_mib": 1, **kw})


def wait_outcomes(pool, n: int, deadline_s: float = 60.0) -> dict:
    """Poll as the service does (select on fds(), then poll) until n outcomes came."""
    out: dict = {}
    deadline = time.monotonic() + deadline_s
    while len(out) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(out)} of {n} outcomes within {deadline_s} s: {out}"
        select.select(pool.fds(), [], [], min(left, 1.0))
        out.update({o.key: o for o in pool.poll(0.0)})
    return out


@pytest.mark.parametrize("source, message", [
    ("def reward(q, a, c):\n    return 1.0 +\n", "source: line 2"),
    ("def score(q, a, c):\n    return 1.0\n", "defines no top-level function 'reward'"),
])
def test_bad_source_is_refused_at_validation(source, message):
    with pytest.raises(ValidationError, match=message):
        UserCodeConfig(source=source)


def test_bad_entry_and_limits_are_refused_at_validation():
    with pytest.raises(ValidationError, match="identifier"):
        UserCodeConfig(source=EXACT, entry="os.system")
    with pytest.raises(ValidationError, match="cpu_s"):
        UserCodeConfig(source=EXACT, cpu_s=10, timeout_s=2.0)


def test_the_trajectory_is_data_in_the_harness_never_code():
    hostile = "'); import os; os.system('x'); print('"
    program = harness(EXACT, "reward", hostile, "1", [hostile])
    # The only statements after the user's source are the harness's own four.
    tail = program.split(EXACT, 1)[1].strip().splitlines()
    assert len(tail) == 4 and tail[0] == "import json as _rlfleet_json"
    assert parse_result("noise\n\x1erlfleet-reward 0.5\n") == 0.5
    with pytest.raises(ValueError, match="no result"):
        parse_result("print('1.0')\n")
    with pytest.raises(ValueError, match="nan"):
        parse_result("\x1erlfleet-reward NaN\n")


HOSTILE = {
    # name: (body of reward(), the reason in the outcome's error)
    # a loop that gets less than its CPU second in the 3 s wall clock (a busy machine)
    # is stopped by the wall clock instead: contained either way
    "infinite loop": ("while True: pass", ("sandbox: cpu_limit", "sandbox: timeout")),
    "fork bomb": ("import os\n    while True: os.fork()", "sandbox: fork_limit"),
    "memory hog": ("hog = bytearray(1 << 30)", "sandbox: memory_limit"),
    "socket open": ("import socket\n    socket.create_connection(('127.0.0.1', 22), timeout=2)",
                    "sandbox: network_denied"),
    "write outside the private directory": ("open('/etc/rlfleet-reward-was-here', 'w').write('x')",
                                            "sandbox: write_denied"),
    "sleeps past the wall clock": ("import time\n    time.sleep(3600)", "sandbox: timeout"),
    "raises": ("return 1 / 0", "sandbox: exception"),
    "returns nan": ("return float('nan')", "ValueError: the reward function returned nan"),
    "returns text": ("return 'yes'", "sandbox: exception"),
}


@needs_root
def test_user_code_scores_and_every_hostile_function_fails_alone():
    pool = UserCode.build(config())
    try:
        pool.submit(job("good", "122"))
        pool.submit(job("wrong", "121"))
        got = wait_outcomes(pool, 2)
        assert (got["good"].reward, got["good"].error) == (1.0, "")
        assert (got["wrong"].reward, got["wrong"].error) == (0.0, "")

        for name, (body, _) in HOSTILE.items():
            hostile = UserCode.build(config(f"def reward(question, answer, completions):\n    {body}\n"))
            try:
                hostile.submit(job(name, "122"))
                outcome = wait_outcomes(hostile, 1)[name]
            finally:
                hostile.close()
            assert outcome.reward == 0.0
            assert outcome.error.startswith(HOSTILE[name][1]), (name, outcome.error)
        assert not os.path.exists("/etc/rlfleet-reward-was-here")

        # The first backend was never disturbed: it still scores, concurrently.
        for k in range(6):
            pool.submit(job(f"again-{k}", "122" if k % 2 else "0"))
        got = wait_outcomes(pool, 6)
        assert [got[f"again-{k}"].reward for k in range(6)] == [0.0, 1.0] * 3
        assert pool.running == 0
    finally:
        pool.close()


@needs_root
def test_a_looping_function_does_not_hold_the_others():
    """concurrency 2: one child spins to its CPU limit while the other slot scores on."""
    slow_or_fast = """
def reward(question, answer, completions):
    if completions[-1] == "spin":
        while True: pass
    return 1.0
"""
    pool = UserCode.build(config(slow_or_fast, concurrency=2))
    try:
        pool.submit(job("spin", "spin"))
        for k in range(4):
            pool.submit(job(f"fast-{k}", "x"))
        got = wait_outcomes(pool, 5)  # in the order they came
        assert all(got[f"fast-{k}"].reward == 1.0 for k in range(4))
        assert got["spin"].error.startswith(("sandbox: cpu_limit", "sandbox: timeout"))
        # All four fast ones were scored by the other slot while the first one still spun.
        assert list(got)[-1] == "spin", list(got)
    finally:
        pool.close()
