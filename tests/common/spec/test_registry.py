"""Seam registries: discovery through entry points, tagged spec tables, lazy building."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from rlfleet.common.spec import seams
from rlfleet.common.spec.errors import describe, dotted
from rlfleet.common.spec.fields import PosInt
from rlfleet.common.spec.registry import Kind, KindConfig, Registry, RegistryError, UnknownKind, import_failure

REPO = Path(__file__).resolve().parents[3]
GROUP = "rlfleet.test_seam"  # no distribution declares it: only monkeypatched entry points

built: list[str] = []  # what build() was asked for, by kind


class AlphaConfig(KindConfig):
    kind: Literal["alpha"] = "alpha"
    size: PosInt = 3


class Alpha(Kind):
    Config = AlphaConfig

    @classmethod
    def build(cls, config, /, **context):
        built.append("alpha")
        return ("alpha", config.size, context)


class BetaConfig(KindConfig):
    kind: Literal["beta"] = "beta"
    rate: float = 0.5


class Beta(Kind):
    Config = BetaConfig


class NotAKind:
    pass


class Unnamed(Kind):
    Config = KindConfig  # kind: str, not a Literal


def entry_points(monkeypatch, *pairs: tuple[str, str]) -> None:
    """Make importlib.metadata.entry_points(group=GROUP) return these (name, value)s."""
    real = importlib.metadata.entry_points
    eps = [importlib.metadata.EntryPoint(name, value, GROUP) for name, value in pairs]

    def fake(**kw):
        return eps if kw.get("group") == GROUP else real(**kw)

    monkeypatch.setattr(importlib.metadata, "entry_points", fake)


@pytest.fixture
def registry(monkeypatch) -> Registry:
    entry_points(monkeypatch, ("beta", f"{__name__}:Beta"), ("alpha", f"{__name__}:Alpha"))
    return Registry("test seam", GROUP, default="alpha")


def holder(registry: Registry) -> type[BaseModel]:
    """A spec section with one tagged table, as common/spec/job.py declares them."""

    class Section(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        thing: registry.config_type() = registry.field()  # type: ignore[valid-type]

    return Section


def errors(model: type[BaseModel], data: dict) -> list[str]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    out = []
    for err in info.value.errors():
        loc, msg = describe(err, model)
        out.append(f"{dotted(loc)}: {msg}")
    return out


# ----------------------------------------------------------------- what is registered
def test_kinds_come_from_entry_points_sorted(registry):
    assert registry.names() == ["alpha", "beta"]
    assert registry.get("beta") is Beta
    assert registry.default_config() == AlphaConfig()


def test_unknown_kind_names_the_registered_ones(registry):
    with pytest.raises(UnknownKind) as info:
        registry.get("gamma")
    assert str(info.value) == "unknown test seam kind 'gamma' (registered: 'alpha', 'beta')"
    assert isinstance(info.value, ValueError)


def test_register_by_hand_and_refuse_duplicates(registry):
    class GammaConfig(KindConfig):
        kind: Literal["gamma"] = "gamma"

    class Gamma(Kind):
        Config = GammaConfig

    assert registry.register(Gamma) is Gamma
    assert registry.names() == ["alpha", "beta", "gamma"]
    registry.register(Gamma)  # the same class again: nothing happens

    class Alpha2(Kind):
        Config = AlphaConfig

    with pytest.raises(RegistryError, match="'alpha' is already registered"):
        registry.register(Alpha2)
    with pytest.raises(RegistryError, match="Config must be a KindConfig with kind: Literal"):
        registry.register(Unnamed)


@pytest.mark.parametrize(("value", "message"), [
    ("no_such_module_xyz:K", "does not load: ModuleNotFoundError"),
    (f"{__name__}:NotAKind", "is not a Kind"),
    (f"{__name__}:Beta", "names kind 'beta'; the two must agree"),
])
def test_a_bad_entry_point_is_named(monkeypatch, value, message):
    entry_points(monkeypatch, ("alpha", value))
    with pytest.raises(RegistryError, match=message) as info:
        Registry("test seam", GROUP, default=None).kinds()
    assert f"{GROUP}:alpha" in str(info.value)


def test_no_kinds_at_all_says_how_to_get_them(monkeypatch):
    entry_points(monkeypatch)
    with pytest.raises(RegistryError, match=r"no test seam kinds registered.*pip install -e \."):
        Registry("test seam", GROUP, default=None).config_type()


# ----------------------------------------------------------------- the tagged table
def test_the_table_takes_only_its_kinds_keys(registry):
    section = holder(registry)
    assert section.model_validate({"thing": {"kind": "beta", "rate": 2}}).thing == BetaConfig(rate=2.0)
    assert section.model_validate({"thing": {"kind": "alpha", "size": 7}}).thing == AlphaConfig(size=7)
    # beta's key under alpha: refused, and the path has no pydantic tag in it
    assert errors(section, {"thing": {"kind": "alpha", "rate": 1.0}}) == ["thing.rate: unknown key"]
    assert errors(section, {"thing": {"kind": "alpha", "sise": 1}}) == [
        "thing.sise: unknown key (did you mean 'size'?)"]
    assert errors(section, {"thing": {"kind": "alpha", "size": 0}}) == ["thing.size: must be > 0, got 0"]


def test_unknown_kind_is_a_validation_error_listing_the_kinds(registry):
    assert errors(holder(registry), {"thing": {"kind": "gamma"}}) == [
        "thing.kind: unknown kind 'gamma' (registered: 'alpha', 'beta')"]


def test_default_kind_when_omitted(registry):
    section = holder(registry)
    assert section.model_validate({}).thing == AlphaConfig()
    assert section.model_validate({"thing": {"size": 5}}).thing == AlphaConfig(size=5)


def test_no_default_makes_kind_required(monkeypatch):
    entry_points(monkeypatch, ("alpha", f"{__name__}:Alpha"))
    section = holder(Registry("test seam", GROUP, default=None))
    assert errors(section, {"thing": {"size": 5}}) == [
        "thing.kind: required key missing (registered: 'alpha')"]
    assert errors(section, {}) == ["thing: required table missing: one with kind = 'alpha'"]


def test_the_table_round_trips_as_json(registry):
    section = holder(registry)
    value = section.model_validate({"thing": {"kind": "beta"}})
    assert section.model_validate(json.loads(value.model_dump_json())) == value


# ----------------------------------------------------------------- building
def test_build_is_lazy_and_gets_the_context(registry):
    built.clear()
    config = holder(registry).model_validate({"thing": {"size": 4}}).thing
    assert built == []  # validating built nothing
    assert registry.build(config, model_path="/m") == ("alpha", 4, {"model_path": "/m"})
    assert built == ["alpha"]
    with pytest.raises(NotImplementedError, match="Beta.build"):
        registry.build(BetaConfig())


def test_every_seam_has_its_default_kind_registered():
    assert {r.group: r.names() for r in seams.SEAMS} == {
        "rlfleet.rollout_engines": ["sim", "torch", "vllm"],
        "rlfleet.policy_losses": ["cispo", "decoupled_ppo", "ppo_clip", "tis", "topr"],
        "rlfleet.trainer_backends": ["megatron", "sim", "torch"],
        "rlfleet.reward_backends": ["pipeline", "remote_http", "rule_pool", "user_code"],
        "rlfleet.reward_dispatch": ["ebf", "fifo"],
        "rlfleet.tasks": ["arithmetic", "frozenlake", "sim", "tool_use"],
        "rlfleet.env_routers": ["affinity", "group_sticky", "least_loaded"],
        "rlfleet.repack_planners": ["laminar", "none"],
    }


def test_the_shipped_kinds_build_what_the_daemons_used_to_build():
    from rlfleet.daemons.env_host.routing_policy import LeastLoaded
    from rlfleet.daemons.repack_manager.planners import NoPlanner
    from rlfleet.daemons.reward_host.backends import RulePool
    from rlfleet.daemons.reward_host.dispatch import FifoDispatch
    from rlfleet.daemons.tasks import get_task
    from rlfleet.daemons.trainer.losses import PPOClipLoss

    loss = seams.POLICY_LOSSES.build(seams.POLICY_LOSSES.default_config())
    assert isinstance(loss, PPOClipLoss) and loss.clip_eps == 0.2
    assert isinstance(seams.REWARD_DISPATCH.build(seams.REWARD_DISPATCH.default_config()), FifoDispatch)
    assert isinstance(seams.ENV_ROUTERS.build(seams.ENV_ROUTERS.default_config()), LeastLoaded)
    assert isinstance(seams.REPACK_PLANNERS.build(seams.REPACK_PLANNERS.default_config()), NoPlanner)
    assert seams.REWARD_BACKENDS.get("rule_pool") is RulePool  # builds worker processes: tests/daemons/reward_host
    assert seams.ROLLOUT_ENGINES.default_config().max_batch == 32  # loads a model: tests/rollout
    lake = seams.TASKS.build(seams.TASKS.get("frozenlake").Config(size=5), max_turns=7)
    assert lake.difficulty() == get_task("frozenlake", size=5, max_turns=7).difficulty()


def test_a_kind_says_whether_its_library_imports_here(tmp_path, monkeypatch):
    """`rlfleet job validate` asks each kind (Kind.unavailable): vllm and megatron have a library to try."""
    assert Kind.unavailable(AlphaConfig()) == ""  # the default: nothing to import
    assert import_failure("json") == ""
    assert import_failure("rlfleet_nope") == ("import rlfleet_nope failed: "
                                             "ModuleNotFoundError: No module named 'rlfleet_nope'")
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text('raise OSError("libtorch_cuda.so: not found")\n')
    # the child that tries the import finds the stand-in first
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    vllm = seams.ROLLOUT_ENGINES.get("vllm")
    assert vllm.unavailable(vllm.Config()) == "import vllm failed: OSError: libtorch_cuda.so: not found"
    (tmp_path / "megatron" / "core").mkdir(parents=True)  # the optional extra rlfleet[megatron], broken
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (tmp_path / "megatron" / "core" / "__init__.py").write_text('raise ImportError("no apex")\n')
    megatron = seams.TRAINER_BACKENDS.get("megatron")
    assert megatron.unavailable(megatron.Config()) == "import megatron.core failed: ImportError: no apex"


def test_validating_a_spec_imports_no_implementation(tmp_path):
    """`rlfleet job validate` stays instant: the kinds' modules hold configs only."""
    sim = tmp_path / "sim.toml"  # the sim kinds too (their check() runs on validation)
    sim.write_text(f"""[job]\nname = "s"\n[model]\npath = {str(REPO / 'models' / 'tiny-qwen2')!r}\n"""
                   """[task.env]\nkind = "sim"\n[trainer.backend]\nkind = "sim"\n""")
    code = textwrap.dedent(f"""
        import sys
        from rlfleet.common.spec.job import load_spec
        load_spec({str(REPO / 'examples' / 'frozenlake.toml')!r})
        load_spec({str(REPO / 'examples' / 'arithmetic-vllm.toml')!r})  # the vllm kind's check too
        assert load_spec({str(sim)!r}).trainer.backend.kind == "sim"
        heavy = sorted(m for m in ("torch", "transformers", "gymnasium", "zmq", "numpy")
                       if m in sys.modules)
        print(",".join(heavy))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
