"""The shipped tiny model (models/tiny-qwen2): loads the standard way, tokenizes task text
losslessly, and is warm-started into the success band it records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gymnasium")

from rlfleet.daemons.tasks import get_task  # noqa: E402
from rlfleet.daemons.tasks.episodes import evaluate_model, generate  # noqa: E402
from rlfleet.tools.evaluate import task_difficulty  # noqa: E402

MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-qwen2"
FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json", "warmstart.json"]


@pytest.fixture(scope="module")
def warmstart() -> dict:
    return json.loads((MODEL / "warmstart.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(MODEL))


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    m = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL))
    m.eval()
    return m


def task_texts() -> list[str]:
    texts = []
    for name in ("arithmetic", "frozenlake"):
        task = get_task(name, **task_difficulty(MODEL, name))
        for p in task.make_prompts("eval", 5, seed=0):
            obs = task.make_env().reset(p)
            texts.append(task.format_turn(obs) + task.target(p, obs))
    return texts + ["999+999=1998", "0-0=0", " \n=LDRU SFHGP"]


def test_checkpoint_files_are_all_there_and_small():
    for name in FILES:
        assert (MODEL / name).is_file(), name
    assert (MODEL / "model.safetensors").stat().st_size < 5 * 2**20


def test_tokenizer_round_trips_task_text(tokenizer):
    for text in task_texts():
        ids = tokenizer(text)["input_ids"]
        assert len(ids) == len(text), text  # one token per character, no <bos>
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        # the env-host encodes with the backend tokenizer directly: same ids
        assert tokenizer.backend_tokenizer.encode(text).ids == ids
    eos = tokenizer.eos_token_id
    assert eos is not None and tokenizer.pad_token_id not in (None, eos)
    assert tokenizer.decode(tokenizer("12")["input_ids"] + [eos], skip_special_tokens=True) == "12"


def test_model_is_a_small_tied_qwen2(model, tokenizer, warmstart):
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.vocab_size == len(tokenizer)
    assert sum(p.numel() for p in model.parameters()) == warmstart["params"]


def test_warmstart_record_is_in_the_band(warmstart):
    for key in ("seed", "steps", "wall_time_s", "tasks"):
        assert key in warmstart, key
    success = warmstart["eval"]["success"]
    assert set(success) == {f"{t}/{m}" for t in ("arithmetic", "frozenlake")
                            for m in ("greedy", "sample")}
    for key, value in success.items():
        assert 0.1 <= value <= 0.6, f"{key}: {value} outside [0.1, 0.6]"


def test_quick_greedy_arithmetic_eval_agrees_with_the_record(model, tokenizer, warmstart):
    task = get_task("arithmetic", **task_difficulty(MODEL, "arithmetic"))
    # The first 16 of the recorded set (make_prompts is prefix-stable); greedy is exact.
    prompts = task.make_prompts("eval", 16, seed=warmstart["eval"]["seed"])
    quick = evaluate_model(model, tokenizer, task, prompts, greedy=True)
    recorded = warmstart["eval"]["success"]["arithmetic/greedy"]
    assert abs(quick - recorded) <= 0.3, (quick, recorded)


def test_model_follows_both_formats(model, tokenizer):
    gen = torch.Generator().manual_seed(0)
    arith = get_task("arithmetic", **task_difficulty(MODEL, "arithmetic"))
    texts = [arith.format_turn(p.question) for p in arith.make_prompts("eval", 32, seed=5)]
    answers = generate(model, tokenizer, texts, arith.max_new_tokens, greedy=False, generator=gen)
    assert sum(arith.parse_action(a) is not None for a in answers) >= 28, answers

    lake = get_task("frozenlake", **task_difficulty(MODEL, "frozenlake"))
    obs = [lake.make_env().reset(p) for p in lake.make_prompts("eval", 32, seed=5)]
    actions = generate(model, tokenizer, [lake.format_turn(o) for o in obs], 1, greedy=False,
                       generator=gen)
    assert sum(lake.parse_action(a) is not None for a in actions) >= 28, actions


TOOLS_MODEL = MODEL.with_name("tiny-qwen2-tools")


def test_the_tool_use_model_is_the_same_architecture_warm_started_on_three_tasks():
    """models/tiny-qwen2-tools (examples/tool_use.toml): same tokenizer and shape as the
    default model, its record in the band for every task, tool use included."""
    for name in FILES:
        assert (TOOLS_MODEL / name).is_file(), name
    assert (TOOLS_MODEL / "tokenizer.json").read_bytes() == (MODEL / "tokenizer.json").read_bytes()
    config, tools_config = (json.loads((m / "config.json").read_text()) for m in (MODEL, TOOLS_MODEL))
    assert config == tools_config
    record = json.loads((TOOLS_MODEL / "warmstart.json").read_text())
    success = record["eval"]["success"]
    assert set(success) == {f"{t}/{m}" for t in ("arithmetic", "frozenlake", "tool_use")
                            for m in ("greedy", "sample")}
    for key, value in success.items():
        assert 0.1 <= value <= 0.6, f"{key}: {value} outside [0.1, 0.6]"
    assert record["hyperparameters"]["tool_share"] > 0

