"""The sim trainer backend in process: its step time follows the model, its weights are
real bytes that change per version, its checkpoints resume like the torch learner's."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from rlfleet.common.spec.job import parse_spec
from rlfleet.common.spec.seams import TRAINER_BACKENDS
from rlfleet.daemons.trainer.checkpointing import STATE_FILE, CheckpointError, checkpoints
from rlfleet.daemons.trainer.evaluation import evaluation_off
from rlfleet.daemons.trainer.sim_learner import SimLearner

from .conftest import scored

REPO = Path(__file__).resolve().parents[3]


class FakeClock:
    """A wall clock that moves only when slept on (and by `cost` per reading, to model
    the step's own work)."""

    def __init__(self, cost: float = 0.0) -> None:
        self.now, self.cost, self.slept = 100.0, cost, []

    def clock(self) -> float:
        self.now += self.cost
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"vocab_size": 151_936}))
    return d


def learner(model_dir, clock: FakeClock | None = None, **kw) -> SimLearner:
    args = {"time_scale": 0.5, "tokens_per_s": 1000.0, "fixed_s": 2.0, "weight_mib": 3, **kw}
    if clock is not None:
        args.update(sleep=clock.sleep, clock=clock.clock)
    return SimLearner(model_dir, **args)


def batch(prompt_len: int = 10, completions=(5, 7)) -> list[list]:
    """Two groups of len(completions) trajectories, one turn each."""
    return [[scored(p, k, float(k % 2), prompt=tuple(range(1, prompt_len + 1)),
                    tokens=tuple([3] * n)) for k, n in enumerate(completions)] for p in range(2)]


def test_step_sleeps_the_modeled_time_and_reports_the_batch(model_dir):
    clock = FakeClock()
    sim = learner(model_dir, clock)
    assert (sim.vocab_size, sim.model, sim.version) == (151_936, None, 0)
    stats = sim.train_step(batch())
    # 4 trajectories: 4 x 10 prompt + 2 x (5 + 7) generated = 64 tokens
    model_s = 2.0 + 64 / 1000.0
    assert clock.slept == [pytest.approx(0.5 * model_s)]
    assert stats == {"loss": 0.0, "reward_mean": 0.5, "reward_std": 0.5, "trajectories": 4,
                     "groups": 2, "rows": 4, "tokens": 24, "batch_tokens": 64,
                     "step_s": pytest.approx(0.5 * model_s), "model_step_s": pytest.approx(model_s),
                     "sim_lag_s": 0.0, "version": 1}
    assert sim.version == 1


def test_step_counts_its_own_work_and_reports_lag_when_behind(model_dir):
    # each clock reading costs 0.01 s of work: the sleep makes up the rest of the target
    clock = FakeClock(cost=0.01)
    sim = learner(model_dir, clock, fixed_s=0.0, tokens_per_s=64.0, time_scale=0.1)  # target 0.1 s
    stats = sim.train_step(batch())
    assert clock.slept == [pytest.approx(0.09)]
    assert stats["step_s"] == pytest.approx(0.11) and stats["sim_lag_s"] == pytest.approx(0.01)
    # a step whose work alone outlasts the model does not sleep, and says by how much it lagged
    clock = FakeClock(cost=1.0)
    sim = learner(model_dir, clock, fixed_s=0.0, tokens_per_s=64.0, time_scale=0.1)
    stats = sim.train_step(batch())
    assert clock.slept == [] and stats["sim_lag_s"] == pytest.approx(2.0 - 0.1)


def test_step_time_on_the_real_clock(model_dir):
    sim = learner(model_dir, fixed_s=0.1, tokens_per_s=640.0, time_scale=1.0)  # 0.1 + 64/640 = 0.2 s
    started = time.perf_counter()
    stats = sim.train_step(batch())
    took = time.perf_counter() - started
    assert took >= 0.2  # never faster than the model; how much later is the machine's load
    assert stats["step_s"] == pytest.approx(took, abs=0.01)


def test_multi_turn_tokens_and_refusals(model_dir):
    sim = learner(model_dir, FakeClock())
    groups = [[scored(0, k, 1.0, prompt=(1, 2, 3), tokens=(4, 5), turns=3) for k in range(2)]]
    stats = sim.train_step(groups)
    assert (stats["tokens"], stats["batch_tokens"], stats["rows"]) == (12, 30, 6)
    with pytest.raises(ValueError, match="at least one group"):
        sim.train_step([])
    with pytest.raises(ValueError, match="different sizes"):
        sim.train_step([batch()[0], batch()[0][:1]])
    with pytest.raises(ValueError, match="no generated tokens"):
        sim.train_step([[scored(0, 0, 1.0, tokens=())]])
    assert sim.version == 1  # refused batches make no version


def test_state_tensors_are_weight_mib_of_fresh_bytes_per_version(model_dir):
    sim = learner(model_dir, FakeClock(), weight_mib=40)
    v0 = sim.state_tensors()
    assert sum(a.nbytes for a in v0.values()) == 40 << 20
    assert [a.nbytes >> 20 for a in v0.values()] == [16, 16, 8]
    assert all(a.dtype == np.float32 for a in v0.values())
    again = sim.state_tensors()
    # the same version: the same bytes (a republish must match), in new arrays
    assert all(np.array_equal(v0[n], again[n]) and v0[n] is not again[n] for n in v0)
    sim.train_step(batch())
    v1 = sim.state_tensors()
    assert all(not np.array_equal(v0[n], v1[n]) for n in v0)
    # the snapshot handed out for version 0 was not touched by making version 1's
    assert all(np.array_equal(v0[n], again[n]) for n in v0)
    assert not any(np.shares_memory(v0[n], v1[n]) for n in v0)


def test_checkpoint_round_trip_and_pruning(model_dir, tmp_path):
    root = tmp_path / "ckpt"
    sim = learner(model_dir, FakeClock())
    for _ in range(3):
        sim.train_step(batch())
        sim.save_checkpoint(root, extra={"step": sim.version})
    assert [p.name for p in checkpoints(root)] == ["step-00000003", "step-00000002"]  # keep=2
    state = json.loads((root / "step-00000003" / STATE_FILE).read_text())
    assert (state["version"], state["backend"], state["step"]) == (3, "sim", 3)
    assert [f.name for f in (root / "step-00000003").iterdir()] == [STATE_FILE]
    resumed = learner(model_dir, FakeClock())
    assert resumed.load_checkpoint(checkpoints(root)[0]) == 3 and resumed.version == 3
    resumed.train_step(batch())
    assert resumed.version == 4


@pytest.mark.parametrize("content, why", [
    (None, "cannot load trainer_state.json: FileNotFoundError"),
    ("{not json", "cannot load trainer_state.json: JSONDecodeError"),
    ('{"time": 1}', "cannot load trainer_state.json: KeyError"),
    ('{"version": -2}', "version must be an int >= 0, got -2"),
])
def test_unreadable_checkpoint_is_named_and_changes_nothing(model_dir, tmp_path, content, why):
    folder = tmp_path / "step-00000007"
    folder.mkdir()
    if content is not None:
        (folder / STATE_FILE).write_text(content)
    sim = learner(model_dir, FakeClock())
    with pytest.raises(CheckpointError, match=why):
        sim.load_checkpoint(folder)
    assert sim.version == 0


def test_model_dir_without_vocab_size_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="vocab_size must be a positive integer, got None"):
        SimLearner(tmp_path, time_scale=1.0, tokens_per_s=1.0, fixed_s=0.0, weight_mib=1)


def test_the_sim_kind_builds_it_from_the_spec(model_dir):
    (model_dir / "model.safetensors").write_bytes(b"")  # [model] path needs a weights file
    spec = parse_spec({"job": {"name": "s"}, "model": {"path": str(model_dir)},
                       "task": {"env": {"kind": "arithmetic"}},
                       "trainer": {"backend": {"kind": "sim", "time_scale": 0.1, "weight_mib": 2}}})
    sim = TRAINER_BACKENDS.build(spec.trainer.backend, spec=spec)
    assert isinstance(sim, SimLearner)
    assert (sim.time_scale, sim.fixed_s, sim.weight_mib) == (0.1, 1.0, 2)
    assert sum(a.nbytes for a in sim.state_tensors().values()) == 2 << 20
    # no policy, no held-out evaluation; a learner with a model still needs the tokenizer
    assert evaluation_off(spec, sim) == "the sim trainer backend has no policy to generate with"
    with_model = type("WithModel", (), {"model": object()})()
    assert evaluation_off(spec, with_model) == f"no tokenizer in {model_dir}"


def test_the_sim_backend_never_imports_torch(model_dir):
    """A sim trainer on a machine of hundreds of simulated rollouts: no torch to load."""
    code = textwrap.dedent(f"""
        import sys
        from rlfleet.daemons.trainer.sim_learner import SimLearner
        from tests.daemons.trainer.conftest import scored
        sim = SimLearner({str(model_dir)!r}, time_scale=0.001, tokens_per_s=1e6, fixed_s=0.0,
                         weight_mib=1)
        sim.train_step([[scored(0, 0, 1.0), scored(0, 1, 0.0)]])
        sim.state_tensors()
        print(",".join(m for m in ("torch", "transformers") if m in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
