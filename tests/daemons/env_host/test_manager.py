"""EnvManager against fake rollouts on real ZeroMQ sockets: whole episodes and every fault
that must stay inside its trajectory."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from rlfleet.common.wire.arrays import Float32Array, Int32Array
from rlfleet.common.wire.messages import GenerateResult, Turn
from rlfleet.daemons.env_host.manager import EnvManager, EnvThreads, ManagerConfig, TurnCodec, check_result
from rlfleet.daemons.env_host.routing import Router
from rlfleet.daemons.tasks import ArithmeticTask, TaskEnv, get_task
from rlfleet.daemons.tasks.frozenlake import optimal_actions, parse_observation

from .fakes import FakeRollout, answer, policy, tokenizer

FAST = ManagerConfig(turn_timeout_s=2.0, trajectory_timeout_s=20.0, max_retries=2, backoff_s=0.01)


@pytest.fixture(scope="module")
def codec() -> TurnCodec:
    return TurnCodec(tokenizer())


@pytest.fixture
def rollouts():
    made: list[FakeRollout] = []

    def make(behaviour, name="r"):
        r = FakeRollout(behaviour, name=name)
        made.append(r)
        return r
    yield make
    for r in made:
        r.close()


async def play(task, prompt, codec, addresses: dict[str, str], config=FAST, index=0, resume=(),
               journal=None, threads=None):
    router = Router(suspect_s=5.0)
    router.update(addresses)
    try:
        return await EnvManager(task=task, prompt=prompt, prompt_id=7, index=index, codec=codec,
                                router=router, config=config, on_turn=journal, resume=resume,
                                threads=threads).run()
    finally:
        router.close()


def frozenlake_policy(text: str) -> str:
    """The shortest-path move from the observation the prompt shows."""
    obs = text.removesuffix("\n=")
    desc, r, c = parse_observation(obs)
    return optimal_actions(desc, r, c)[0]


def test_arithmetic_episode_is_scored_and_carries_tokens(codec, rollouts):
    task = get_task("arithmetic")
    prompt = task.make_prompts("train", 1, seed=3)[0]
    r = rollouts(answer(prompt.answer, version=4))
    traj = asyncio.run(play(task, prompt, codec, {"r0": r.address}))

    assert traj.dropped_reason == "", traj.info
    assert (traj.trajectory_id, traj.group_id, traj.prompt_id) == ("p7-g0", "p7", 7)
    assert traj.env_reward == 1.0 and len(traj.turns) == 1
    turn = traj.turns[0]
    assert turn.action == prompt.answer and turn.observation == prompt.question
    assert turn.weight_version == 4
    # The prompt tokens are what evaluate.py feeds the model: tokenizer(format_turn(obs)).
    text = task.format_turn(prompt.question)
    assert turn.prompt_token_ids.tolist() == tokenizer()(text)["input_ids"]
    assert tokenizer().decode(turn.prompt_token_ids.tolist(), skip_special_tokens=True) == text
    assert turn.token_ids.tolist()[-1] == tokenizer().eos_token_id  # the end token is trained on
    assert len(turn.logprobs) == len(turn.token_ids)
    req = r.requests[0]
    assert req.max_new_tokens == task.max_new_tokens + 1 and req.trajectory_id == "p7-g0"


def test_frozenlake_multi_turn_episode_reaches_the_goal(codec, rollouts):
    task = get_task("frozenlake", size=4, max_turns=12)
    prompt = task.make_prompts("train", 1, seed=5)[0]
    r = rollouts(policy(frozenlake_policy))
    journaled: list[tuple[str, int]] = []

    async def journal(tid, n, turn):
        journaled.append((tid, n))

    traj = asyncio.run(play(task, prompt, codec, {"r0": r.address}, journal=journal))
    assert traj.dropped_reason == "", traj.info
    assert traj.env_reward == 1.0
    assert len(traj.turns) >= 6 and len(r.requests) == len(traj.turns)
    assert journaled == [("p7-g0", n) for n in range(len(traj.turns))]
    # Each turn is conditioned on the observation the previous action produced.
    assert traj.turns[0].observation.startswith("P")
    assert task.reward(prompt, [t.action for t in traj.turns]) == 1.0


class HangingEnv(TaskEnv):
    def __init__(self, task):
        self.inner = task.make_env()

    def reset(self, prompt):
        return self.inner.reset(prompt)

    def step(self, action_text):
        time.sleep(30)  # hung: the turn timeout must cut it off
        return self.inner.step(action_text)


class RaisingEnv(HangingEnv):
    def step(self, action_text):
        raise RuntimeError("the simulator crashed")


class EnvTask(ArithmeticTask):
    env_calls_inline = False  # not arithmetic's own env: no longer vouched for

    def __init__(self, env_cls, inline=False):
        super().__init__()
        self.env_cls = env_cls
        self.env_calls_inline = inline

    def make_env(self):
        return self.env_cls(ArithmeticTask())


def test_hung_env_is_dropped_with_env_timeout_and_others_go_on(codec, rollouts):
    task_hung, task_ok = EnvTask(HangingEnv), get_task("arithmetic")
    prompt = task_ok.make_prompts("train", 1)[0]
    r = rollouts(answer(prompt.answer))
    config = ManagerConfig(turn_timeout_s=0.5, trajectory_timeout_s=5.0, max_retries=0)

    async def both():
        return await asyncio.gather(play(task_hung, prompt, codec, {"r0": r.address}, config),
                                    play(task_ok, prompt, codec, {"r0": r.address}, config, index=1))

    hung, ok = asyncio.run(both())
    assert hung.dropped_reason == "env_timeout" and "0.5 s" in hung.info["error"]  # the turn's timeout ended it
    assert ok.dropped_reason == "" and ok.env_reward == 1.0


@pytest.mark.parametrize("inline", [False, True])
def test_raising_env_is_dropped_with_env_error(codec, rollouts, inline):
    task = EnvTask(RaisingEnv, inline)
    prompt = task.make_prompts("train", 1)[0]
    r = rollouts(answer("1"))
    traj = asyncio.run(play(task, prompt, codec, {"r0": r.address}))
    assert traj.dropped_reason == "env_error"
    assert "RuntimeError: the simulator crashed" in traj.info["error"]
    assert traj.turns == []


def test_inline_env_calls_take_no_thread(codec, rollouts):
    task = get_task("arithmetic")
    assert task.env_calls_inline and not get_task("frozenlake").env_calls_inline
    prompt = task.make_prompts("train", 1)[0]
    r = rollouts(answer(prompt.answer))
    threads = EnvThreads()
    traj = asyncio.run(play(task, prompt, codec, {"r0": r.address}, threads=threads))
    assert traj.dropped_reason == "" and traj.env_reward == 1.0
    assert threads.threads == 0


def garbage(kind: str):
    def reply(_srv, req):
        if kind == "vocab":
            return GenerateResult(req.request_id, Int32Array([5, 999]), Float32Array([-1, -1]), 0, "stop")
        if kind == "length":
            return GenerateResult(req.request_id, Int32Array([5, 2]), Float32Array([-1]), 0, "stop")
        if kind == "nan":
            return GenerateResult(req.request_id, Int32Array([5, 2]), Float32Array([math.nan, -1]), 0, "stop")
        return GenerateResult(req.request_id, Int32Array([]), Float32Array([]), 0, "error", "CUDA OOM")
    return reply


@pytest.mark.parametrize("kind", ["vocab", "length", "nan", "error"])
def test_garbage_is_retried_then_dropped_as_rollout_garbage(codec, rollouts, kind):
    task = get_task("arithmetic")
    prompt = task.make_prompts("train", 1)[0]
    r = rollouts(garbage(kind))
    traj = asyncio.run(play(task, prompt, codec, {"r0": r.address}))
    assert traj.dropped_reason == "rollout_garbage", traj.info
    assert len(r.requests) == FAST.max_retries + 1  # retried, then given up
    assert traj.info["reissues"] == str(FAST.max_retries + 1)


def test_garbage_from_one_rollout_is_retried_on_another(codec, rollouts):
    task = get_task("arithmetic")
    prompt = task.make_prompts("train", 1)[0]
    bad, good = rollouts(garbage("nan"), "bad"), rollouts(answer(prompt.answer), "good")
    router_addresses = {"bad": bad.address, "good": good.address}
    for index in range(4):  # whichever rollout is picked first, the result is good
        traj = asyncio.run(play(task, prompt, codec, router_addresses, index=index))
        assert traj.dropped_reason == "" and traj.env_reward == 1.0
    assert len(good.requests) == 4


def test_rollout_dying_mid_request_reissues_the_turn_to_the_other(codec, rollouts):
    task = get_task("arithmetic")
    prompt = task.make_prompts("train", 1)[0]
    stuck = threading.Event()

    def hold(srv, req):  # take the request, never answer: die instead
        stuck.set()
        srv._die.wait(10)
        return None

    dying = rollouts(hold, "dying")
    # A turn timeout longer than the test may run: only the disconnect can re-issue the turn.
    config = ManagerConfig(turn_timeout_s=600.0, trajectory_timeout_s=1200.0, max_retries=2)

    async def scenario():
        router = Router()
        router.update({"dying": dying.address})
        mgr = EnvManager(task=task, prompt=prompt, prompt_id=1, index=0, codec=codec,
                         router=router, config=config)
        run = asyncio.create_task(mgr.run())
        await asyncio.to_thread(stuck.wait, 5)
        healthy = rollouts(answer(prompt.answer), "healthy")
        router.update({"dying": dying.address, "healthy": healthy.address})
        await asyncio.to_thread(dying.die)
        traj = await run
        router.close()
        return traj, healthy

    traj, healthy = asyncio.run(scenario())
    assert traj.dropped_reason == "" and traj.env_reward == 1.0
    assert len(dying.requests) == 1 and len(healthy.requests) == 1
    assert traj.info["rollouts"] == "healthy" and traj.info["reissues"] == "1"


def test_silent_rollout_times_out_and_is_aborted(codec, rollouts):
    task = get_task("arithmetic")
    prompt = task.make_prompts("train", 1)[0]
    silent = rollouts(lambda srv, req: None, "silent")
    config = ManagerConfig(turn_timeout_s=0.3, trajectory_timeout_s=5.0, max_retries=1)
    traj = asyncio.run(play(task, prompt, codec, {"silent": silent.address}, config))
    assert traj.dropped_reason == "rollout_timeout"
    assert len(silent.requests) == 2
    deadline = time.monotonic() + 2
    while len(silent.aborts) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert silent.requests[0].request_id in silent.aborts  # the rollout's slot was freed


def test_trajectory_timeout(codec, rollouts):
    task = get_task("frozenlake", size=4, max_turns=12)
    prompt = task.make_prompts("train", 1)[0]

    def slow_wrong(srv, req):
        time.sleep(0.15)
        return answer("X")(srv, req)  # an invalid move: the episode goes on

    r = rollouts(slow_wrong)
    config = ManagerConfig(turn_timeout_s=1.0, trajectory_timeout_s=1.0, max_retries=0)
    traj = asyncio.run(play(task, prompt, codec, {"r0": r.address}, config))
    assert traj.dropped_reason == "trajectory_timeout"
    assert 3 <= len(traj.turns) < 12


def test_resume_replays_journaled_turns_then_continues(codec, rollouts):
    task = get_task("frozenlake", size=4, max_turns=12)
    prompt = task.make_prompts("train", 1, seed=5)[0]
    first = rollouts(policy(frozenlake_policy))
    full = asyncio.run(play(task, prompt, codec, {"r0": first.address}))
    assert full.env_reward == 1.0 and len(full.turns) >= 3

    second = rollouts(policy(frozenlake_policy))
    resumed = asyncio.run(play(task, prompt, codec, {"r0": second.address}, resume=full.turns[:2]))
    assert resumed.env_reward == 1.0
    assert [t.action for t in resumed.turns] == [t.action for t in full.turns]
    assert len(second.requests) == len(full.turns) - 2  # the first two were not generated again

    # A journal that does not match the environment restarts the episode from scratch.
    bogus = [Turn(Int32Array([1]), Int32Array([2]), Float32Array([-1.0]), 0, "not the map", "R")]
    third = rollouts(policy(frozenlake_policy))
    restarted = asyncio.run(play(task, prompt, codec, {"r0": third.address}, resume=bogus))
    assert restarted.env_reward == 1.0 and len(third.requests) == len(full.turns)


def test_no_rollout_at_all_is_dropped_after_retries(codec):
    task = get_task("arithmetic")
    prompt = task.make_prompts("train", 1)[0]
    config = ManagerConfig(turn_timeout_s=0.2, trajectory_timeout_s=5.0, max_retries=1)
    traj = asyncio.run(play(task, prompt, codec, {}, config))
    assert traj.dropped_reason == "rollout_timeout" and "no live rollout" in traj.info["error"]


def test_check_result_names_the_problem():
    ok = GenerateResult("r", Int32Array([5, 2]), Float32Array([-0.1, -0.2]), 0, "stop")
    assert check_result(ok, 38, 4) is None
    too_long = GenerateResult("r", Int32Array([5] * 5), Float32Array([-0.1] * 5), 0, "length")
    assert "max_new_tokens" in check_result(too_long, 38, 4)
    positive = GenerateResult("r", Int32Array([5]), Float32Array([0.5]), 0, "stop")
    assert "logprobs" in check_result(positive, 38, 4)
    negative_id = GenerateResult("r", Int32Array([-3]), Float32Array([-0.5]), 0, "stop")
    assert "vocabulary" in check_result(negative_id, 38, 4)


def test_check_result_fast_path_agrees_with_the_per_value_rule():
    """check_result tests ranges with min/max/sum; the edges a sum or max could miss."""
    def lp(values: list[float]) -> str | None:
        return check_result(GenerateResult("r", Int32Array([5] * len(values)), Float32Array(values), 0, "stop"),
                            38, 8)
    nan, inf = float("nan"), float("inf")
    assert "logprobs" in lp([-0.1, nan, -0.2])  # max() ignores a NaN after the first value
    assert "logprobs" in lp([nan, -0.1])
    assert "logprobs" in lp([-inf, -0.1])
    assert "logprobs" in lp([-0.1, inf])
    assert "logprobs" in lp([-inf, inf])  # the sum is NaN
    # Finite values whose sum overflows float64? float32's range cannot: -3e38 * 8 is finite;
    # the fallback scan keeps the per-value rule whatever the sum does.
    assert lp([-3e38] * 8) is None
    assert lp([1e-4, -0.5]) is None and "logprobs" in lp([2e-4, -0.5])
    ids = GenerateResult("r", Int32Array([5, 38, 2]), Float32Array([-0.1] * 3), 0, "stop")
    assert check_result(ids, 38, 8) == "token ids outside the vocabulary [0, 38): [38]"
