"""Hardware-affinity routing on real processes (`rlfleet run`, etcd, every daemon): one sim
rollout process with two hardware pools (2 H800s, 2 H20s), the sim task with two tagged
kinds. The rollouts' records carry their hardware and slots; the env-host's bindings
(routing/<id>) show each tag on its preferred hardware, off it only as a counted fallback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.members import members_from

from .helpers import SIM_HEAD, one_host, sim_backend, sim_lengths, wait_for
from .test_longtail_sim import TINY_MODEL, finish, needs_model, run_dir_of, steps

AFFINITY_JOB = SIM_HEAD + """\
[task]
group_size = 4
max_turns = 3

[task.env]
kind = "sim"
max_new_tokens = 1024
kinds = [{{ tag = "prefill_heavy", share = 1, turns = 3, observation_chars = 500, max_new_tokens = 16 }},
         {{ tag = "decode_heavy", share = 1, turns = 1, max_new_tokens = 1024 }}]

[trainer]
batch_size = 16
max_steps = 100000
checkpoint_every = 1000

""" + sim_backend(time_scale=0.1, fixed_s=5.0) + """\
[rollout]
mode = "trajectory"

[rollout.engine]
kind = "sim"
time_scale = 0.3
pools = [{{ hardware = "h800", profile = "h800-7b", rollouts = 2, max_batch = 8 }},
         {{ hardware = "h20", profile = "h20-7b", rollouts = 2, max_batch = 8 }}]

""" + sim_lengths(median=200, p99=1000) + """\
[env_host]
max_concurrent = 12        # < a pool's 16 slots: the preferred pool never saturates, so
turn_timeout_s = 30        # a tag off its pool would be a routing error, not load

[env_host.routing]
kind = "affinity"
prefer = {{ prefill_heavy = "h800", decode_heavy = "h20" }}

[reward_host.backend]
kind = "rule_pool"
workers = 1

[repack_manager.planner]
kind = "none"

""" + one_host()


@needs_model
def test_each_tag_goes_to_its_preferred_hardware(tmp_path, etcd):
    job = "simaffinity"
    spec = tmp_path / f"{job}.toml"
    spec.write_text(AFFINITY_JOB.format(job=job, runs=tmp_path / "runs", model=TINY_MODEL))
    proc = subprocess.Popen([sys.executable, "-m", "rlfleet.tools.cli", "run", str(spec), "--no-view",
                             "--etcd", etcd.endpoints_arg, "--duration", "120"],  # a bound: stopped below
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    store, keys = EtcdStore(etcd.endpoints_arg), JobKeys(job)
    try:
        run_dir = run_dir_of(tmp_path, job)
        sims = wait_for("4 simulated rollouts", lambda: (lambda ms: ms if len(ms) == 4 else None)(
            [m for m in members_from(keys, store.get_prefix(keys.role_members_prefix("rollout")))
             if m.address("requests")]), 60)
        assert sorted((m.info["hardware"], m.info["slots"]) for m in sims) == \
            [("h20", 8), ("h20", 8), ("h800", 8), ("h800", 8)]

        def bindings():
            got = store.get_prefix(keys.routing_prefix)
            counts = got[0].value["counts"] if got else {}  # one env-host: its bindings
            enough = all(sum(c["routed"] for c in counts.get(tag, {}).values()) >= 8
                         for tag in ("prefill_heavy", "decode_heavy"))
            return got[0].value if enough else None
        published = wait_for("both tags routed", bindings, 60)
        env_host = next(m for m in members_from(keys, store.get_prefix(keys.role_members_prefix("env-host"))))
        with urllib.request.urlopen(env_host.metrics, timeout=5) as response:
            scraped = response.read().decode()
        wait_for("a training step", lambda: len(steps(run_dir)) >= 1, 60)
    finally:
        store.close()
        proc.send_signal(signal.SIGTERM)
    finish(proc)
    assert published["kind"] == "affinity"
    assert published["prefer"] == {"prefill_heavy": "h800", "decode_heavy": "h20"}
    for tag, preferred in published["prefer"].items():
        by_hardware = published["counts"][tag]
        assert by_hardware[preferred]["fallbacks"] == 0
        off = {hw: c for hw, c in by_hardware.items() if hw != preferred}
        assert all(c["routed"] == c["fallbacks"] for c in off.values()), by_hardware  # off only as fallback
        assert by_hardware[preferred]["routed"] > sum(c["routed"] for c in off.values()), by_hardware
    # Its prometheus counters say the same, per tag and hardware.
    routed = {(m["tag"], m["hardware"]) for m in _samples(scraped, "rlfleet_env_routed_total")}
    assert {("prefill_heavy", "h800"), ("decode_heavy", "h20")} <= routed, scraped[-2000:]


def _samples(text: str, name: str) -> list[dict[str, str]]:
    """The label sets of a metric's samples in prometheus' text format."""
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels = line[len(name) + 1:line.index("}")]
            out.append(dict((k, v.strip('"')) for k, v in (p.split("=", 1) for p in labels.split(","))))
    return out
