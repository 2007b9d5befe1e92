"""Helpers for integration tests: spec files, waiting on etcd state, processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.spec.errors import SpecError
from rlfleet.common.spec.job import load_spec
from rlfleet.tools.lab.job import wait_for as poll_until

T = TypeVar("T")

FAST_SPEC = """\
[job]
name = "{job}"
runs_dir = "{runs}"

[etcd]
lease_ttl_s = 2.0
retry_timeout_s = 0.5

[model]
path = "{model}"

[task.env]
kind = "arithmetic"

[task]
"""


# The head of the simulated-fleet specs (sim tasks and engines: tests/integration/test_*_sim.py):
# a 3 s lease, the job's runs under the test's folder; each test goes on with its [task].
SIM_HEAD = """\
[job]
name = "{job}"
runs_dir = "{runs}"

[etcd]
lease_ttl_s = 3.0
retry_timeout_s = 1.0

[model]
path = "{model}"

"""


def sim_backend(*, time_scale: float, fixed_s: float) -> str:
    """[trainer.backend] of a simulated trainer: 200k tokens/s plus `fixed_s` a step,
    scaled by `time_scale`, 1 MiB of weights."""
    return (f"[trainer.backend]\nkind = \"sim\"\ntime_scale = {time_scale}\ntokens_per_s = 200000\n"
            f"fixed_s = {fixed_s}\nweight_mib = 1\n\n")


def sim_lengths(*, median: int, p99: int) -> str:
    """[rollout.engine.lengths] (lognormal) of a simulated fleet, and its [relay] (1 MiB chunks)."""
    return f"[rollout.engine.lengths]\nkind = \"lognormal\"\nmedian = {median}\np99 = {p99}\n\n[relay]\nchunk_mib = 1\n\n"


def one_host(rollouts: int = 1) -> str:
    """[placement]: every role on localhost, `rollouts` rollout processes (a str.format template)."""
    return ("[[placement.hosts]]\nname = \"localhost\"\nroles = {{ resource-manager = 1, repack-manager = 1, "
            f"trainer = 1, relay = 1, rollout = {rollouts}, env-host = 1, reward-host = 1 }}}}\n")


REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = REPO / "models" / "tiny-qwen2"


def spec_errors(path: Path, text: str) -> list[str]:
    """Write ``text`` to ``path``, load it as a job spec and return the errors it must
    raise, each without the ``<path>: `` in front."""
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return [e.removeprefix(f"{path}: ") for e in info.value.errors]

def agent_host_placement(host: str) -> str:
    """[placement] for one node agent's tests: `host` runs a resource-manager and a
    reward-host (the agent under test acts for it); every other role is placed on a
    host nobody acts for."""
    return f"""
[[placement.hosts]]
name = "{host}"
roles = {{ resource-manager = 1, reward-host = 1 }}

[[placement.hosts]]
name = "elsewhere"
roles = {{ repack-manager = 1, trainer = 1, relay = 1, rollout = 1, env-host = 1 }}
"""


def small_job(*, eval_every_steps: int, max_steps: int, checkpoint_every: int = 100, eval_size: int = 8,
              trainer: str = "", env_host: str = "", extra: str = "") -> str:
    """What a whole-fleet test of the tiny model trains, after FAST_SPEC's [task]: groups
    of 4, batches of 8, 16 trajectories at once; ``trainer``, ``env_host``: more keys of
    those tables; ``extra``: the test's own tables."""
    return (f"group_size = 4\neval_size = {eval_size}\neval_every_steps = {eval_every_steps}\n\n"
            f"[trainer]\nbatch_size = 8\nmax_steps = {max_steps}\ncheckpoint_every = {checkpoint_every}\n{trainer}\n"
            f"[env_host]\nmax_concurrent = 16\n{env_host}{extra}")


def write_spec(tmp_path: Path, job: str = "itest", extra: str = "", *,
               model: Path | str = TINY_MODEL) -> Path:
    """tmp_path/<job>.toml: FAST_SPEC (short lease TTL, runs under tmp_path) on `model`,
    then `extra` verbatim: keys that continue [task], then the test's own sections."""
    path = tmp_path / f"{job}.toml"
    path.write_text(FAST_SPEC.format(job=job, runs=tmp_path / "runs", model=model) + extra)
    return path


def spec_store(tmp_path: Path, endpoints, job: str) -> EtcdStore:
    """A store on ``endpoints`` holding job ``job``'s spec (write_spec's)."""
    store = EtcdStore(endpoints)
    store.put(JobKeys(job).spec, load_spec(write_spec(tmp_path, job=job)).to_dict())
    return store


@contextlib.contextmanager
def store_with_spec(tmp_path: Path, etcd, job: str) -> Iterator[EtcdStore]:
    """spec_store on the test's etcd, closed after."""
    with spec_store(tmp_path, etcd.endpoints, job) as s:
        yield s


def wait_for(what: str, fn: Callable[[], T], timeout_s: float = 30.0, every_s: float = 0.05) -> T:
    """Poll fn until it returns something truthy; fail with `what` on timeout."""
    return poll_until(what, fn, timeout_s, every_s)


def rlfleet(*args: str, log: Path | None = None) -> subprocess.Popen:
    out = open(log, "ab") if log else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "rlfleet.tools.cli", *args], stdout=out, stderr=out,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def start_daemon(role: str, member_id: str, *, job: str, etcd: str, log_dir: Path, run_dir: Path,
                 args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> subprocess.Popen:
    """`rlfleet daemon ROLE` of `job` as its own process (session), logging to
    log_dir/<member_id>.log, writing its run files under run_dir."""
    return subprocess.Popen(
        [sys.executable, "-m", "rlfleet.tools.cli", "daemon", role, "--job", job, "--etcd", etcd,
         "--id", member_id, *args],
        stdout=open(log_dir / f"{member_id}.log", "ab"), stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO,
        env={**os.environ, "RLFLEET_RUN_DIR": str(run_dir), **(env or {})})


def stop(proc: subprocess.Popen, timeout_s: float = 20.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


class CountingStore(EtcdStore):
    """A real store that records the reads (get) and swaps it is asked for, so a test can
    assert how many etcd requests a protocol makes."""

    def __init__(self, endpoints: str) -> None:
        super().__init__(endpoints)
        self.calls: list[str] = []

    def get(self, key):
        self.calls.append("get")
        return super().get(key)

    def swap(self, key, expected_mod_revision, value, lease=None):
        self.calls.append("swap")
        return super().swap(key, expected_mod_revision, value, lease)
