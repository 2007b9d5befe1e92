"""The tool-use task (daemons/tasks/tool_use.py): its rules, and hostile tool calls run
in the real sandbox by a real EnvManager, each dropped with its reason while the other
trajectories are served."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import pytest

from rlfleet.common.sandbox.parent import SandboxResult
from rlfleet.daemons.env_host.manager import EnvManager, ManagerConfig, TurnCodec
from rlfleet.daemons.env_host.routing import Router
from rlfleet.daemons.tasks import get_task
from rlfleet.daemons.tasks.tool_use import ToolFailure, ToolUseTask

from .fakes import FakeRollout, policy, tokenizer

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root (docs/operations/sandbox.md)")


def test_reward_needs_calls_then_the_product():
    task = get_task("tool_use")
    prompt = task.make_prompts("train", 1)[0]
    a, b = map(int, prompt.question.split("*"))
    assert prompt.answer == str(a * b)
    call = f"<{prompt.question}>"
    assert task.reward(prompt, [call, prompt.answer]) == 1.0
    assert task.reward(prompt, [prompt.answer]) == 1.0           # answering at once is allowed
    assert task.reward(prompt, [call, call]) == 0.0                # never answered
    assert task.reward(prompt, ["12", prompt.answer]) == 0.0       # the first turn was no call
    assert task.reward(prompt, [call, call, prompt.answer]) == 0.0  # more turns than max_turns
    assert task.parse_action(" <1*2> ") == "<1*2>" and task.parse_action("1*2") is None


@needs_root
def test_an_episode_calls_the_tool_then_answers():
    task = get_task("tool_use")
    prompt = task.make_prompts("eval", 1)[0]
    env = task.make_env()
    obs = env.reset(prompt)
    assert task.format_turn(obs) == prompt.question + "="
    call = task.target(prompt, obs)
    obs, reward, done, info = env.step(call)
    assert (obs, reward, done) == (f"{prompt.question}={call}{prompt.answer}", 0.0, False)
    assert info["tool_call"] and not info["tool_error"]
    assert task.target(prompt, obs) == prompt.answer
    assert env.step(prompt.answer)[1:3] == (1.0, True)


@needs_root
def test_an_expression_that_raises_is_an_observation_not_a_failure():
    task = get_task("tool_use")
    env = task.make_env()
    env.reset(task.make_prompts("train", 1)[0])
    obs, reward, done, info = env.step("<37*>")
    assert obs.endswith("<37*>?") and not done and info["tool_error"]


def test_a_call_on_the_last_turn_ends_the_episode_without_running():
    task = get_task("tool_use", max_turns=1)
    env = task.make_env()
    env.reset(task.make_prompts("train", 1)[0])
    _, reward, done, info = env.step("<1*1>")
    assert (reward, done, info["truncated"]) == (0.0, True, True)


ESCAPE = Path("/tmp") / f"rlfleet-tool-escape-{uuid.uuid4().hex}"
# The model's alphabet has no letters, so a test double maps the call "<N>" to a
# hostile program; everything from there on is the real env, sandbox and manager.
HOSTILE = {
    # infinite loop: its CPU limit, or on a busy machine the wall clock first (both contain it)
    "1": ("any(iter(int, 1))", ("cpu_limit", "timeout")),
    "2": ("[__import__('os').fork() for _ in iter(int, 1)]", "fork_limit"),  # fork bomb
    "3": ("bytearray(1 << 31)", "memory_limit"),                        # memory hog
    "4": ("__import__('socket').create_connection(('1.1.1.1', 53))", "network_denied"),
    "5": (f"open({str(ESCAPE)!r}, 'w').write('escaped')", "write_denied"),
    "6": ("__import__('time').sleep(3600)", "timeout"),
}


class HostileToolUse(ToolUseTask):
    def run_tool(self, expression: str) -> SandboxResult:
        return super().run_tool(HOSTILE[expression][0] if expression in HOSTILE else expression)


@needs_root
def test_hostile_tool_calls_are_dropped_with_their_reason_and_others_are_served():
    task = HostileToolUse(tool_timeout_s=2.0)
    prompts = task.make_prompts("train", len(HOSTILE) + 2, seed=5)
    hostile_of = dict(zip((p.question for p in prompts), HOSTILE))

    def model(text: str) -> str:
        """Hostile call on the first prompts' first turn; the right moves elsewhere."""
        question, _, rest = text.partition("=")
        if not rest and question in hostile_of:
            return f"<{hostile_of[question]}>"
        return f"<{question}>" if not rest else rest.rsplit(">", 1)[1].removesuffix("=")

    rollout = FakeRollout(policy(model))
    codec = TurnCodec(tokenizer())
    config = ManagerConfig(turn_timeout_s=10.0, trajectory_timeout_s=30.0, max_retries=0)

    async def play_all():
        router = Router(suspect_s=5.0)
        router.update({"r0": rollout.address})
        try:
            return await asyncio.gather(*(
                EnvManager(task=task, prompt=p, prompt_id=i, index=0, codec=codec, router=router,
                           config=config).run() for i, p in enumerate(prompts)))
        finally:
            router.close()

    try:
        trajectories = asyncio.run(play_all())
    finally:
        rollout.close()
    for traj, prompt in zip(trajectories, prompts):
        if prompt.question in hostile_of:
            reasons = HOSTILE[hostile_of[prompt.question]][1]
            assert traj.dropped_reason == "env_error", traj.info
            assert any(f"ToolFailure: tool call '{hostile_of[prompt.question]}': {reason}" in traj.info["error"]
                       for reason in ((reasons,) if isinstance(reasons, str) else reasons)), traj.info
        else:
            assert traj.dropped_reason == "" and traj.env_reward == 1.0, traj.info
            assert len(traj.turns) == 2
    assert not ESCAPE.exists()


def test_a_tool_failure_names_the_call_and_the_reason():
    exc = ToolFailure("9**9**9", "cpu_limit", "2.00 s of CPU (limit 2 s)")
    assert str(exc) == "tool call '9**9**9': cpu_limit (2.00 s of CPU (limit 2 s))"
