"""The job spec: shipped examples load, bad specs fail with precise, complete messages."""

import json
import shutil
import textwrap
from pathlib import Path

import pytest

from rlfleet.common.spec import (
    ROLES,
    SINGLETON_ROLES,
    JobSpec,
    SpecError,
    load_spec,
    parse_spec,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.toml"))

MINIMAL = """\
[job]
name = "t"
[model]
path = "../models/tiny-qwen2"
[task]
name = "arithmetic"
"""


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """tmp_path/examples/<copies> and a fake tmp_path/models/tiny-qwen2; cwd = tmp_path."""
    model = tmp_path / "models" / "tiny-qwen2"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
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
    assert spec.task.name == name.removesuffix(".toml")
    assert spec.trainer.batch_size % spec.task.group_size == 0
    assert spec.all_roles() == {
        "resource-manager": 2, "trainer": 1, "relay": 1, "rollout": 1,
        "env-host": 1, "reward-host": 1, "repack-manager": 1,
    }


def test_example_specifics(tree):
    arith = load_spec("examples/arithmetic.toml")
    assert (arith.task.group_size, arith.trainer.batch_size) == (8, 32)
    lake = load_spec("examples/frozenlake.toml")
    assert lake.task.max_turns == 12


@pytest.mark.skipif(
    not (REPO / "models" / "tiny-qwen2" / "config.json").exists(),
    reason="models/tiny-qwen2 not in the repo yet",
)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_shipped_examples_load_in_place(example):
    spec = load_spec(example)
    assert spec.model.path == (REPO / "models" / "tiny-qwen2").resolve()


def test_defaults(tree):
    Path("examples/min.toml").write_text(MINIMAL)
    spec = load_spec("examples/min.toml")
    assert spec.etcd.endpoints == ("127.0.0.1:2379",)
    assert spec.etcd.lease_ttl_s == 3.0 and spec.etcd.refresh_interval_s == 1.0
    assert spec.model.dtype == "float32"
    assert (spec.task.group_size, spec.task.max_turns, spec.task.difficulty) == (8, 1, {})
    assert spec.trainer.batch_size == 32 and spec.trainer.max_staleness is None
    assert spec.rollout.engine == "torch" and spec.relay.transport == "tcp"
    assert spec.env_host.trajectory_timeout_s == 300 and spec.reward_host.workers == 2
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
    with pytest.raises(Exception):
        spec.trainer.batch_size = 4
    with pytest.raises(Exception):
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
        ('[etcd]\nendpoints = "127.0.0.1:2379"', "etcd.endpoints: expected a list, got '127.0.0.1:2379'"),
        ("[rollout]\ntemperature = nan", "rollout.temperature: must be a finite number, got nan"),
        ("[rollout]\ntemperature = inf", "rollout.temperature: must be a finite number, got inf"),
        ("[rollout]\ntop_p = 1.5", "rollout.top_p: must be <= 1, got 1.5"),
        ('[rollout]\nengine = "gpu"', "rollout.engine: must be one of 'torch', 'vllm', 'sim', got 'gpu'"),
        ("[relay]\nkeep_versions = 0", "relay.keep_versions: must be >= 1, got 0"),
        ("[trainer]\nmax_staleness = -1", "trainer.max_staleness: must be >= 0, got -1"),
        ("[task.difficulty]\nlevel = true", "task.difficulty.level: expected an integer, a number or a string, got True"),
        ("[task.difficulty]\nlevel = [1]", "task.difficulty.level: expected an integer, a number or a string, got [1]"),
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
        '[job]\nname = "t"\n[model]\ndtype = "float32"\n[task]\nname = "arithmetic"\n',
        "model.path: required key missing",
    )


def test_missing_required_sections(tree):
    assert errors_of("[trainer]\nbatch_size = 8\n") == [
        "examples/bad.toml: job.name: required key missing",
        "examples/bad.toml: model.path: required key missing",
        "examples/bad.toml: task.name: required key missing",
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


@pytest.mark.parametrize("endpoint", ["localhost", "localhost:0", "h:70000", "http://h:2379", ":2379"])
def test_bad_endpoint(tree, endpoint):
    assert_one_error(
        MINIMAL + f'[etcd]\nendpoints = ["10.0.0.1:2379", "{endpoint}"]\n',
        f"etcd.endpoints[1]: must be 'host:port' with port 1..65535, got {endpoint!r}",
    )


def test_good_endpoints(tree):
    Path("examples/ok.toml").write_text(
        MINIMAL + '[etcd]\nendpoints = ["etcd-1.example.com:2379", "[::1]:2379", "10.0.0.3:1"]\n'
    )
    assert len(load_spec("examples/ok.toml").etcd.endpoints) == 3


def test_empty_endpoints(tree):
    assert_one_error(MINIMAL + "[etcd]\nendpoints = []\n", "etcd.endpoints: must not be empty, got []")


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
        endpoints = ["nohost"]
        [model]
        dtype = "float16"
        [task]
        name = "arithmetic"
        group_size = 8
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
        prefix + "etcd.endpoints[0]: must be 'host:port' with port 1..65535, got 'nohost'",
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
