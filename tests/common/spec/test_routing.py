"""`[env_host.routing]` against the rest of the spec: an affinity `prefer` table may name
only the task's tags and the sim pools' hardware labels; the pools' shape."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.common.spec.errors import SpecError
from rlfleet.common.spec.job import load_spec

MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-qwen2"
needs_model = pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="models/tiny-qwen2 not built")

SPEC = """\
[job]
name = "t"
[model]
path = "{model}"
[task]
max_turns = 4
[task.env]
kind = "sim"
kinds = [{{ tag = "prefill_heavy", share = 1, turns = 4, observation_chars = 3000, max_new_tokens = 64 }},
         {{ tag = "decode_heavy", share = 1, turns = 1 }}]
[rollout.engine]
kind = "sim"
{engine}
pools = [{{ hardware = "h800", profile = "h800-7b", rollouts = 2 }},
         {{ hardware = "h20", profile = "h20-7b", rollouts = 3, max_batch = 64 }}]
[env_host.routing]
kind = "affinity"
prefer = {prefer}
"""


def load(tmp_path: Path, prefer: str, engine: str = ""):
    path = tmp_path / "job.toml"
    path.write_text(SPEC.format(model=MODEL, prefer=prefer, engine=engine))
    return load_spec(str(path))


def errors(tmp_path: Path, prefer: str, engine: str = "") -> list[str]:
    with pytest.raises(SpecError) as info:
        load(tmp_path, prefer, engine)
    return [e.split(": ", 1)[1] for e in info.value.errors]


@needs_model
def test_a_prefer_table_of_known_tags_and_hardware_validates(tmp_path):
    spec = load(tmp_path, '{ prefill_heavy = "h800", decode_heavy = "h20" }')
    engine = spec.rollout.engine
    assert engine.rollouts == 5 and engine.hardware_labels() == ["h800", "h20"]
    assert [(label, c.profile, c.timing().max_batch) for label, c in engine.fleet()] == \
        [("h800", "h800-7b", 256)] * 2 + [("h20", "h20-7b", 64)] * 3
    assert engine.cost() == pytest.approx(2 * 2.85 + 3 * 1.0)


@needs_model
def test_unknown_tag_or_hardware_is_refused(tmp_path):
    assert errors(tmp_path, '{ prefill = "h800" }') == [
        "env_host.routing.prefer.prefill: unknown tag 'prefill' (the task's tags: 'prefill_heavy', 'decode_heavy')"]
    assert errors(tmp_path, '{ decode_heavy = "h30" }') == [
        "env_host.routing.prefer.decode_heavy: unknown hardware 'h30' (the rollouts': 'h800', 'h20')"]


@needs_model
def test_pools_own_the_fleet_size_and_the_labels(tmp_path):
    prefer = '{ decode_heavy = "h20" }'
    assert any("the pools hold 5 rollouts, got rollouts = 4" in e for e in errors(tmp_path, prefer, "rollouts = 4"))
    assert any("each pool names its own" in e for e in errors(tmp_path, prefer, 'hardware = "x"'))
    assert load(tmp_path, prefer, "rollouts = 5").rollout.engine.rollouts == 5
