"""Fixtures for the trainer tests: a tiny random Qwen2 model and trajectory builders."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from rlfleet.common.wire.arrays import Float32Array, Int32Array
from rlfleet.common.wire.messages import ScoredTrajectory, Trajectory, Turn
from tests.tiny_qwen2 import save_random_qwen2

VOCAB = 38  # the character tokenizer of tools/build_model.py: 4 specials + 34 characters


def build_tiny_model(out: Path, seed: int = 0) -> Path:
    """A random Qwen2 (hidden 32, 2 layers) with the character tokenizer's vocabulary.

    Random on purpose, not a copy of models/tiny-qwen2: the tests' numbers must not
    move when the shipped model is rebuilt.
    """
    return save_random_qwen2(out, vocab=VOCAB, hidden=32, intermediate=64, max_positions=128, seed=seed)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def scored(prompt_id: int, k: int, reward: float, *, prompt=(1, 5, 6), tokens=(7, 8),
           logprobs=None, version: int = 0, dropped_reason: str = "", reward_error: str = "",
           turns: int = 1) -> ScoredTrajectory:
    """A ScoredTrajectory with ids following docs/design/dataflow.md (p<prompt>-g<k>)."""
    lp = logprobs if logprobs is not None else [-1.0] * len(tokens)
    turn = Turn(prompt_token_ids=Int32Array(list(prompt)), token_ids=Int32Array(list(tokens)),
                logprobs=Float32Array(list(lp)), weight_version=version, observation="obs", action="act")
    traj = Trajectory(trajectory_id=f"p{prompt_id}-g{k}", prompt_id=prompt_id, group_id=f"p{prompt_id}",
                      task="arithmetic", turns=[turn] * turns, env_reward=reward,
                      dropped_reason=dropped_reason)
    return ScoredTrajectory(trajectory=traj, reward=reward, reward_error=reward_error)



def send_groups(sender, prompts: range, version: int = 0, timeout_s: float = 30) -> None:
    """Groups of two (rewards 1 and 0) for each prompt id, sent and acked. 3 prompt + 2 or 3
    generated tokens each: a group is 11 tokens, a batch of 2 groups 22."""
    for p in prompts:
        for st in (scored(p, 0, 1.0, tokens=(7, 8), version=version),
                   scored(p, 1, 0.0, tokens=(9, 10, 2), version=version)):
            sender.send(st.trajectory.trajectory_id, st)
    assert sender.flush(timeout_s), f"{sender.pending()} trajectories not acked"

def claim_prompts(store, job: str, up_to: int = 1_000_000) -> None:
    """Play every env-host: prompts [0, up_to) claimed in etcd, so the trainer's intake
    (daemons/trainer/claimed.py) takes trajectories of any of them."""
    from rlfleet.common.control.keys import JobKeys
    store.put(JobKeys(job).prompts_cursor, {"next": up_to, "claims": {"test-feeder": [[0, up_to]]}})


@contextmanager
def sim_fleet(tmp_path: Path, etcd, job: str, spec_text: str, *, store_timeout_s: float | None = None):
    """A trainer and relays of `job` as real daemons (start(role, member_id)), the spec in
    etcd (the relay reads it there), a shared-memory root of their own; all stopped after."""
    from rlfleet.common.control.etcd_store import EtcdStore
    from rlfleet.common.control.keys import JobKeys
    from rlfleet.common.spec.job import load_spec
    from tests.integration.helpers import TINY_MODEL, start_daemon, stop, write_spec

    spec = write_spec(tmp_path, job, spec_text, model=TINY_MODEL)
    store = EtcdStore(etcd.endpoints, **({} if store_timeout_s is None else {"timeout_s": store_timeout_s}))
    store.put(JobKeys(job).spec, load_spec(spec).to_dict())
    shm_root = f"/dev/shm/rlfleet-test-{uuid.uuid4().hex[:8]}"
    procs: list[subprocess.Popen] = []

    def start(role: str, member_id: str) -> subprocess.Popen:
        args = ("--spec", str(spec)) if role == "trainer" else ("--host", "host-a")
        proc = start_daemon(role, member_id, job=job, etcd=etcd.endpoints_arg, log_dir=tmp_path,
                            run_dir=tmp_path / "run", args=args, env={"RLFLEET_RELAY_SHM_ROOT": shm_root})
        procs.append(proc)
        return proc

    try:
        yield start, store
    finally:
        for proc in procs:
            stop(proc)
        store.close()
        shutil.rmtree(shm_root, ignore_errors=True)
