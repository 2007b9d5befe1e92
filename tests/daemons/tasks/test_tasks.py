"""Tasks: deterministic prompts, disjoint splits, rule rewards, the real FrozenLake env."""

from __future__ import annotations

import pytest

from rlfleet.daemons.tasks import Prompt, get_task, split_of

pytest.importorskip("gymnasium")

from rlfleet.daemons.tasks.frozenlake import (  # noqa: E402
    parse_observation,
    render,
    shortest_path,
)

# gymnasium's classic 4x4 map: (1,1), (1,3), (2,3) and (3,0) are holes.
CLASSIC = ["SFFF", "FHFH", "FFFH", "HFFG"]


def lake_prompt(rows: list[str]) -> Prompt:
    return Prompt("frozenlake", "eval", "test", "\n".join(rows), "")


# ------------------------------------------------------------------ prompts and splits
@pytest.mark.parametrize("name", ["arithmetic", "frozenlake"])
def test_prompts_are_deterministic(name):
    task = get_task(name)
    a = task.make_prompts("train", 50, seed=3)
    assert a == get_task(name).make_prompts("train", 50, seed=3)
    assert a[:20] == task.make_prompts("train", 20, seed=3)  # prefix-stable in n
    assert [p.question for p in a] != [p.question for p in task.make_prompts("train", 50, seed=4)]
    assert len({p.uid for p in a}) == 50
    assert all(p.task == name and p.split == "train" for p in a)


@pytest.mark.parametrize("name,n", [("arithmetic", 2000), ("frozenlake", 400)])
def test_train_and_eval_are_disjoint(name, n):
    task = get_task(name)
    train = {p.question for s in range(3) for p in task.make_prompts("train", n, seed=s)}
    evals = {p.question for s in range(3) for p in task.make_prompts("eval", n // 4, seed=s)}
    assert train and evals and not train & evals
    assert all(split_of(name, q) == "eval" for q in evals)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="task: must be one of"):
        get_task("chess")
    with pytest.raises(ValueError, match="digits"):
        get_task("arithmetic", digits=0)
    with pytest.raises(ValueError, match=r"no knob\(s\) \['size'\]"):
        get_task("arithmetic", size=4)
    with pytest.raises(ValueError, match="size"):
        get_task("frozenlake", size=1)
    with pytest.raises(ValueError, match="split"):
        get_task("arithmetic").make_prompts("test", 3)  # type: ignore[arg-type]


def test_prompt_round_trips_through_a_dict():
    p = get_task("frozenlake").make_prompts("eval", 1)[0]
    assert Prompt.from_dict(p.to_dict()) == p


# ------------------------------------------------------------------------ arithmetic
def test_arithmetic_answers_are_right_and_in_range():
    task = get_task("arithmetic", digits=3)
    for p in task.make_prompts("train", 500, seed=0):
        a, op, b = (p.question.partition("+") if "+" in p.question
                    else p.question.partition("-"))
        assert len(a) <= 3 and len(b) <= 3
        assert int(p.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
    assert task.format_turn("37+85") == "37+85="


def test_arithmetic_rule_reward():
    task = get_task("arithmetic")
    p = Prompt("arithmetic", "eval", "t", "37+85", "122")
    assert task.reward(p, ["122"]) == 1.0
    assert task.reward(p, [" 122\n"]) == 1.0  # surrounding whitespace is not the answer
    for wrong in ["121", "0122", "12 2", "122=", "", "abc", "-122"]:
        assert task.reward(p, [wrong]) == 0.0, wrong
    assert task.reward(p, ["122", "122"]) == 0.0  # single-turn: one completion only


def test_arithmetic_env_is_one_step():
    task = get_task("arithmetic")
    p = task.make_prompts("eval", 1)[0]
    env = task.make_env()
    assert env.reset(p) == p.question
    obs, reward, done, info = env.step(p.answer)
    assert (obs, reward, done, info["invalid_action"]) == ("", 1.0, True, False)
    with pytest.raises(RuntimeError):
        env.step(p.answer)
    env.reset(p)
    assert env.step("x")[1:3] == (0.0, True)


# ------------------------------------------------------------------------ frozenlake
def test_observation_rendering():
    assert render(CLASSIC, 0, 0) == "PFFF\nFHFH\nFFFH\nHFFG"
    assert parse_observation(render(CLASSIC, 2, 1)) == (CLASSIC, 2, 1)
    task = get_task("frozenlake")
    obs = task.make_env().reset(lake_prompt(CLASSIC))
    assert obs == "PFFF\nFHFH\nFFFH\nHFFG"
    assert task.format_turn(obs) == obs + "\n="


def test_bfs_path_reaches_the_goal_on_the_real_env():
    task = get_task("frozenlake")
    env = task.make_env()
    for p in task.make_prompts("eval", 20, seed=0) + [lake_prompt(CLASSIC)]:
        path = shortest_path(p.question.split("\n"))
        assert path is not None and len(path) <= task.max_turns
        obs, total = env.reset(p), 0.0
        for i, action in enumerate(path):
            obs, reward, done, info = env.step(action)
            total += reward
            assert done == (i == len(path) - 1) and not info["invalid_action"]
        assert total == 1.0 and info["terminated"]
        assert obs.split("\n")[-1][-1] == "P"  # the agent stands on G
        assert task.reward(p, path) == 1.0
        assert task.reward(p, path + ["L", "garbage"]) == 1.0  # texts after the end: ignored


def test_a_hole_ends_the_episode_with_zero():
    task = get_task("frozenlake")
    env = task.make_env()
    p = lake_prompt(CLASSIC)
    env.reset(p)
    assert env.step("R")[1:3] == (0.0, False)
    obs, reward, done, info = env.step("D")  # onto the hole at (1, 1)
    assert (reward, done, info["terminated"]) == (0.0, True, True)
    assert obs.split("\n")[1] == "FPFH"
    with pytest.raises(RuntimeError):
        env.step("D")
    assert task.reward(p, ["R", "D", "R", "R"]) == 0.0


def test_garbage_action_is_a_no_op_turn():
    task = get_task("frozenlake", max_turns=4)
    assert [task.parse_action(t) for t in ["R", " D\n", "r", "RR", "", "left", "0"]] == \
        ["R", "D", None, None, None, None, None]
    env = task.make_env()
    start = env.reset(lake_prompt(CLASSIC))
    for turn, text in enumerate(["x", "", "RR"], start=1):
        obs, reward, done, info = env.step(text)
        assert (obs, reward, done) == (start, 0.0, False)
        assert info["invalid_action"] and info["turns"] == turn
    obs, reward, done, info = env.step("??")  # the 4th turn: max_turns reached
    assert (reward, done, info["truncated"], info["terminated"]) == (0.0, True, True, False)


def test_max_turns_ends_a_wandering_episode():
    task = get_task("frozenlake", max_turns=5)
    env = task.make_env()
    env.reset(lake_prompt(CLASSIC))
    results = [env.step(a) for a in ["L", "U", "L", "U", "L"]]  # bumps into the walls
    assert [r[2] for r in results] == [False] * 4 + [True]
    assert sum(r[1] for r in results) == 0.0 and results[-1][3]["truncated"]


# ------------------------------------------------------------------------------- sim
def test_sim_prompts_are_distinct_deterministic_and_split():
    task = get_task("sim")
    a = task.make_prompts("train", 300, seed=3)
    assert a == get_task("sim").make_prompts("train", 300, seed=3)
    assert a[:50] == task.make_prompts("train", 50, seed=3)  # prefix-stable in n
    assert [p.question for p in a[:3]] == ["3:0:0", "3:0:1", "3:0:2"]
    assert len({p.question for p in a}) == len({p.uid for p in a}) == 300
    assert all(p.task == "sim" and p.split == "train" and p.answer == "" for p in a)
    other_seed = {p.question for p in task.make_prompts("train", 300, seed=4)}
    evals = {p.question for p in task.make_prompts("eval", 300, seed=3)}
    assert not other_seed & {p.question for p in a} and not evals & {p.question for p in a}
    with pytest.raises(ValueError, match="split"):
        task.make_prompts("test", 3)  # type: ignore[arg-type]


def test_sim_prompts_survive_the_shipped_character_tokenizer():
    """The sim engine derives a prompt's length from its token ids: no character may be lost."""
    from tokenizers import Tokenizer

    from tests.integration.helpers import TINY_MODEL

    tok = Tokenizer.from_file(str(TINY_MODEL / "tokenizer.json"))
    task = get_task("sim")
    for p in task.make_prompts("train", 20, seed=12) + task.make_prompts("eval", 5, seed=12):
        text = task.format_turn(task.make_env().reset(p))
        assert tok.decode(tok.encode(text).ids) == text


def test_sim_reward_is_a_seeded_coin_per_trajectory():
    from rlfleet.daemons.tasks import undecoded_action

    task = get_task("sim", success_rate=0.3)
    prompts = task.make_prompts("train", 250, seed=0)
    rewards = [[task.reward(p, [undecoded_action(f"p{i}-g{k}", 0)]) for k in range(8)]
               for i, p in enumerate(prompts)]
    flat = [r for g in rewards for r in g]
    assert set(flat) == {0.0, 1.0}
    assert abs(sum(flat) / len(flat) - 0.3) < 0.04  # 2000 draws: 4 standard errors ~ 0.04
    # groups of 8 at 0.3 are all-equal with probability 0.7^8 + 0.3^8 ~ 6%: most have variance
    assert sum(len(set(g)) == 2 for g in rewards) > 0.85 * len(rewards)
    # deterministic: the same (seed, trajectory id) gives the same reward, in another task object
    again = get_task("sim", success_rate=0.3)
    assert again.reward(prompts[7], [undecoded_action("p7-g3", 0)]) == rewards[7][3]
    # another job seed draws other coins
    seed9 = get_task("sim", success_rate=0.3).make_prompts("train", 250, seed=9)
    assert [[task.reward(p, [undecoded_action(f"p{i}-g{k}", 0)]) for k in range(8)]
            for i, p in enumerate(seed9)] != rewards
    p = prompts[0]
    assert get_task("sim", success_rate=0.0).reward(p, ["x"]) == 0.0
    assert get_task("sim", success_rate=1.0).reward(p, ["x"]) == 1.0


def test_sim_env_is_one_inline_step_without_decoding():
    task = get_task("sim", max_new_tokens=4096)
    assert (task.max_new_tokens, task.max_turns) == (4096, 1)
    assert task.env_calls_inline and not task.decodes_completion
    assert get_task("arithmetic").decodes_completion and get_task("frozenlake").decodes_completion
    assert get_task("sim").max_new_tokens == 16384  # Laminar's 16K output cap
    p = task.make_prompts("train", 1, seed=5)[0]
    env = task.make_env()
    assert env.reset(p) == "5:0:0"
    obs, reward, done, info = env.step("<undecoded p0-g1 turn 0>")
    assert (obs, done, info) == ("", True, {})
    assert reward == task.reward(p, ["<undecoded p0-g1 turn 0>"])  # the reward-host's check agrees
    with pytest.raises(RuntimeError):
        env.step("again")


def test_sim_bad_knobs_are_refused_with_their_names():
    with pytest.raises(ValueError, match=r"max_new_tokens: must be an integer in \[1, 131072\], got 0"):
        get_task("sim", max_new_tokens=0)
    with pytest.raises(ValueError, match=r"success_rate: must be a number in \[0, 1\], got 1.5"):
        get_task("sim", success_rate=1.5)
    with pytest.raises(ValueError, match=r"no knob\(s\) \['digits'\]"):
        get_task("sim", digits=2)


def test_sim_kind_defaults_are_the_tasks():
    from rlfleet.common.spec.seams import TASKS
    from rlfleet.daemons.tasks.sim import MAX_NEW_TOKENS_LIMIT

    config = TASKS.get("sim").Config()
    assert {**config.model_dump(exclude={"kind"}), "max_turns": 1} == get_task("sim").difficulty()
    bound = next(m.le for m in type(config).model_fields["max_new_tokens"].metadata
                 if getattr(m, "le", None) is not None)
    assert bound == MAX_NEW_TOKENS_LIMIT
    built = TASKS.build(TASKS.get("sim").Config(max_new_tokens=100, success_rate=0.9))
    assert {k: built.difficulty()[k] for k in ("max_new_tokens", "success_rate")} == {
        "max_new_tokens": 100, "success_rate": 0.9}


def test_sim_env_latency_is_normal_clipped_at_zero_and_scaled():
    task = get_task("sim", step_latency_mean_s=10.0, step_latency_std_s=5.0, time_scale=0.01)
    env = task.make_env()
    env.reset(task.make_prompts("train", 1)[0])
    draws = [env.latency_s() for _ in range(4000)]
    assert min(draws) >= 0.0
    mean = sum(draws) / len(draws)
    assert abs(mean - 0.1) < 0.004, mean  # 10 s x 0.01; clipping at 0 adds ~0.0001
    std = (sum((d - mean) ** 2 for d in draws) / len(draws)) ** 0.5
    assert abs(std - 0.05) < 0.004, std
    assert get_task("sim").make_env().latency_s() == 0.0  # off by default: no sleep at all


def test_sim_env_steps_its_turns_asynchronously_and_scores_the_last():
    import asyncio
    import time

    task = get_task("sim", max_turns=3, step_latency_mean_s=2.0, time_scale=0.01)
    p = task.make_prompts("train", 1, seed=1)[0]
    env = task.make_env()
    first = env.reset(p)

    async def play() -> list:
        return [await env.astep(f"a{k}") for k in range(3)]

    t0 = time.monotonic()
    steps = asyncio.run(play())
    assert time.monotonic() - t0 >= 3 * 0.02 * 0.99  # three latencies of 2 s x 0.01
    assert [s[2] for s in steps] == [False, False, True]
    assert [s[1] for s in steps[:2]] == [0.0, 0.0]
    assert steps[0][0] != first and steps[0][0].startswith(first)  # a new observation per turn
    assert steps[2][1] == task.reward(p, ["a0", "a1", "a2"])  # the reward-host's check agrees


def test_sim_env_failures_raise_at_the_configured_rate():
    from rlfleet.daemons.tasks.sim import SimEnvFailure

    task = get_task("sim", failure_rate=0.25)
    prompts = task.make_prompts("train", 2000)
    failed = 0
    for p in prompts:
        env = task.make_env()
        env.reset(p)
        try:
            env.step("x")
        except SimEnvFailure:
            failed += 1
    assert abs(failed / 2000 - 0.25) < 0.04


def test_sim_zero_variance_share_makes_groups_without_signal():
    from rlfleet.daemons.tasks import undecoded_action

    task = get_task("sim", zero_variance_share=0.5)
    prompts = task.make_prompts("train", 400)
    groups = [{task.reward(p, [undecoded_action(f"t{k}", 0)]) for k in range(8)} for p in prompts]
    flat = sum(len(g) == 1 for g in groups) / len(groups)
    # half fixed by design, plus 2 x 0.5^8 of the coin-flip half
    assert 0.43 < flat < 0.58, flat
    fixed = [g.pop() for g in groups if len(g) == 1]
    assert 0.3 < sum(fixed) / len(fixed) < 0.7  # half all-1, half all-0


def test_sim_kinds_tag_prompts_by_share_with_their_own_shapes():
    task = get_task("sim", max_turns=4, max_new_tokens=512, kinds=[
        {"tag": "prefill_heavy", "share": 1, "turns": 4, "observation_chars": 300, "max_new_tokens": 32},
        {"tag": "decode_heavy", "share": 3, "turns": 1}])
    prompts = task.make_prompts("train", 2000)
    tags = [task.tag(p) for p in prompts]
    assert abs(tags.count("prefill_heavy") / 2000 - 0.25) < 0.04
    heavy = prompts[tags.index("prefill_heavy")]
    light = prompts[tags.index("decode_heavy")]
    assert (task.max_new_tokens_for(heavy), task.max_new_tokens_for(light)) == (32, 512)
    env = task.make_env()
    assert len(env.reset(heavy)) == len(heavy.question) + 300
    assert [env.step("x")[2] for _ in range(4)] == [False, False, False, True]
    assert get_task("arithmetic").tag(get_task("arithmetic").make_prompts("train", 1)[0]) == "arithmetic"
    with pytest.raises(ValueError, match=r"kinds\[0\].turns: must be an integer in \[1, max_turns = 4\], got 5"):
        get_task("sim", max_turns=4, kinds=[{"tag": "a", "share": 1, "turns": 5}])
