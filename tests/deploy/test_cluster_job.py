"""The cluster path end to end, on a lab of five real systemd hosts (tools/lab, docs/operations/lab.md).

`site.yml` brings the cluster up from bare hosts (etcd on h1-h3 with TLS and client-cert
auth, rlfleet from the wheelhouse, the units, one agent per host, Prometheus on h5), a
second run changes nothing; `job.yml` submits the arithmetic example, and the agents start
what the elected resource-manager places; `rlfleet status` and `switchover` work from the
controller, a machine that is no host of the job. While it trains, the faults of a bare-metal
deployment: kill -9 of a daemon (systemd restarts it), one etcd member stopped, a rollout
host powered off (its relay leaves the chain, its turns are re-issued), the trainer host
rebooted (it resumes from its checkpoint and journal). Then the operator ends the job at a
step (the spec's max_steps, applied with `systemctl reload`): it trains to it, and the
accounting invariant holds over the journals of every host. Last, `stop.yml`'s stop is
durable: a power-cycled host starts nothing of the stopped job, and `rlfleet status` says
STOPPED and exits 0.

The tests run in file order on one lab (a cluster takes minutes to build). Figures are
printed and saved to runs/deploy/cluster.json. Run by `make test-deploy` (root, RLFLEET_LAB=1).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rlfleet.common.control.keys import MEMBERS, JobKeys
from rlfleet.tools.lab.job import (
    ENV_FILE,
    JOB,
    RLFLEET,
    RUN_DIR,
    LabJob,
    job_spec,
    recap,
    task_timing,
    wait_for,
    with_job_env,
)

from .conftest import lab_cli, module_lab

# Each step waits on a cluster of five hosts sharing two cores: minutes, not the suite default.
pytestmark = [pytest.mark.lab, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "ansible"
LAB = "e2e"
SUBNET = "10.213.0"
HOSTS = 5
OBSERVER = "h5"  # never faulted: the test reads etcd and Prometheus from it
PLACED_DAEMONS = 10  # examples/cluster-arithmetic.toml: trainer, 2 relays, 2 rollouts, env, reward, 2 RMs, repack
RESULTS = REPO / "runs" / "deploy" / "cluster.json"
figures: dict[str, Any] = {}
J = LabJob(LAB, HOSTS, OBSERVER)
LAB_HOSTS = Path(os.environ.get("RLFLEET_LAB_ROOT", "/var/lib/rlfleet-lab")) / LAB / "hosts"  # their root filesystems
host_sh, etcd, trainer, version, advances, playbook, unit = (J.host_sh, J.etcd, J.trainer, J.version, J.advances,
                                                             J.playbook, J.unit)
diagnostics = J.diagnostics


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("cluster")
    with module_lab(request, J, SUBNET, RESULTS, figures):
        proc, took = playbook("site.yml")
        figures["site_yml_first_s"] = round(took, 1)
        figures["site_yml_first_recap"] = recap(proc.stdout)
        figures["site_yml_first_slowest_tasks"] = task_timing(proc.stdout)  # where the CI's deploy time goes
        yield tmp


def test_site_yml_a_second_time_changes_nothing(cluster):
    proc, took = playbook("site.yml")
    rows = recap(proc.stdout)
    figures["site_yml_rerun_s"] = round(took, 1)
    figures["site_yml_rerun_slowest_tasks"] = task_timing(proc.stdout)
    figures["site_yml_rerun_recap"] = rows
    assert set(rows) == {f"h{i}" for i in range(1, HOSTS + 1)}, proc.stdout[-3000:]
    assert all(r["changed"] == 0 and r["failed"] == 0 for r in rows.values()), rows


def test_a_submitted_job_is_placed_and_trains(cluster):
    t0 = time.monotonic()
    playbook("job.yml", "-e", f"rlfleet_job_spec={job_spec(cluster, 1_000_000)}")
    wait_for("the first training step", lambda: version() >= 1, timeout_s=300, every_s=0.5)
    figures["submit_to_first_step_s"] = round(time.monotonic() - t0, 1)
    placed = etcd("placement/")
    assert len(placed) == PLACED_DAEMONS, placed
    members = etcd("members/")
    hosts = {(v["role"], v["host"]) for v in members.values()}
    assert {("relay", "h2"), ("relay", "h3"), ("rollout", "h2"), ("rollout", "h3"), ("trainer", "h1")} <= hosts, hosts
    assert all(v.get("addresses", {}) == {} or all(f"{SUBNET}." in a for a in v["addresses"].values())
               for v in members.values()), members  # published on the cluster network, not loopback
    advances(20, 240, "across five hosts")


def controller_rlfleet(*args: str) -> subprocess.CompletedProcess:
    """`rlfleet ARGS` on the lab's controller, a machine that is no host of the job (this
    one, in the lab's network namespace), with the job's etcd credentials read from the
    observer's env file."""
    root = LAB_HOSTS / OBSERVER / "merged"
    env = dict(os.environ)
    for line in (root / ENV_FILE.lstrip("/")).read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip().startswith("RLFLEET_"):
            value = value.strip().strip("'\"")
            on_host = root / value.lstrip("/")
            env[name.strip()] = str(on_host) if value.startswith("/") and on_host.exists() else value
    return subprocess.run(["ip", "netns", "exec", LAB, sys.executable, "-m", "rlfleet.tools.cli", *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_status_and_switchover_work_from_the_controller(cluster):
    """The lab's hosts share this machine's kernel, so its boot id: a member is judged by
    its lease, never by looking its pid up here (issue 30: every member was called dead)."""
    status = wait_for("`rlfleet status` healthy from the controller", lambda: (
        p := controller_rlfleet("status", "--job", JOB)).returncode == 0 and p, timeout_s=120, every_s=2)
    assert "dead" not in status.stdout, status.stdout
    keys = JobKeys(JOB)
    leader = J.etcd("leader/resource-manager")[keys.leader("resource-manager")]["id"]
    standby = next(v["id"] for v in J.etcd(f"{MEMBERS}/resource-manager/").values() if v["id"] != leader)
    moved = controller_rlfleet("switchover", "resource-manager", "--to", standby, "--job", JOB, "--timeout", "120")
    assert moved.returncode == 0, moved.stdout + moved.stderr
    assert J.etcd("leader/resource-manager")[keys.leader("resource-manager")]["id"] == standby


def test_prometheus_has_every_target_up(cluster):
    def targets() -> list[dict]:
        out = host_sh(OBSERVER, "curl -sf http://127.0.0.1:9090/api/v1/targets?state=active").stdout
        return json.loads(out)["data"]["activeTargets"]

    def all_up() -> list[dict] | None:
        found = targets()
        daemons = [t for t in found if t["scrapePool"] == "rlfleet-daemons"]
        return found if len(daemons) == PLACED_DAEMONS and all(t["health"] == "up" for t in found) else None

    found = wait_for(f"Prometheus scraping {PLACED_DAEMONS} daemons with every target up", all_up, timeout_s=120,
                     every_s=2)
    pools = {}
    for t in found:
        pools[t["scrapePool"]] = pools.get(t["scrapePool"], 0) + 1
    figures["prometheus_targets_up"] = pools
    figures["memory_per_host_while_training_mib"] = {r["host"]: r["pss_mib"] for r in json.loads(
        lab_cli("status", "--name", LAB, "--output", "json").stdout)["hosts"]}
    assert pools.get("rlfleet-agents") == HOSTS and pools.get("etcd") == 3, pools


def test_kill_9_of_a_daemon_is_restarted_by_systemd(cluster):
    before = unit("h4", "reward-host-0")
    host_sh("h4", f"kill -9 {before['MainPID']}")
    after = wait_for("systemd to restart reward-host-0",
                     lambda: (u := unit("h4", "reward-host-0"))["MainPID"] not in ("0", before["MainPID"])
                     and u["ActiveState"] == "active" and u, timeout_s=90)
    assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1, (before, after)
    wait_for("the restarted reward-host registered", lambda: any(
        v.get("pid") == int(after["MainPID"]) for v in etcd("members/reward-host/").values()), timeout_s=90)
    advances(10, 180, "after the reward-host's restart")


def test_a_stalled_main_loop_is_killed_by_the_watchdog_and_restarted(cluster):
    """WATCHDOG=1 comes from the main loop: a loop stuck in its role's work (the test
    failpoint, given to one unit by a runtime drop-in) stops the pings, and systemd
    kills the daemon after WatchdogSec and starts it again."""
    name = f"rlfleet@{JOB}:repack-manager-0.service"
    stall = "/var/lib/rlfleet/stall-repack-manager"
    host_sh("h5", f"mkdir -p '/run/systemd/system/{name}.d' && printf '[Service]\\nEnvironment="
                  f"RLFLEET_DAEMON_FAILPOINT=stall_if_file:repack-manager:{stall}\\n' "
                  f"> '/run/systemd/system/{name}.d/stall.conf' && systemctl daemon-reload && systemctl restart '{name}'")
    try:
        started = wait_for("repack-manager-0 running with the failpoint", lambda: (u := unit("h5", "repack-manager-0"))
                           ["ActiveState"] == "active" and u, timeout_s=90)
        host_sh("h5", f"touch {stall}")
        t0 = time.monotonic()
        wait_for("the stalled loop to take the stall file", lambda: host_sh("h5", f"test ! -e {stall}", check=False)
                 .returncode == 0, timeout_s=30)
        after = wait_for("systemd's watchdog to kill and restart it", lambda: (u := unit("h5", "repack-manager-0"))
                         ["MainPID"] not in ("0", started["MainPID"]) and u["ActiveState"] == "active" and u,
                         timeout_s=120, every_s=2)
        figures["watchdog_stall_to_restart_s"] = round(time.monotonic() - t0, 1)
        assert int(after["NRestarts"]) == int(started["NRestarts"]) + 1, (started, after)
        said = host_sh("h5", f"journalctl --no-pager -u '{name}' -o cat | grep -i watchdog", check=False).stdout
        assert "watchdog timeout" in said.lower(), said
    finally:
        host_sh("h5", f"rm -rf '/run/systemd/system/{name}.d' && systemctl daemon-reload", check=False)


def test_training_goes_on_with_one_etcd_member_stopped(cluster):
    host_sh("h2", "systemctl stop rlfleet-etcd")
    try:
        advances(20, 180, "with etcd on h2 stopped")
    finally:
        host_sh("h2", "systemctl start rlfleet-etcd")


def prom_sum(metric: str) -> float:
    return J.prom(f"sum({metric})")


def test_a_rollout_host_powered_off_leaves_the_chain_and_its_turns_are_reissued(cluster):
    relays = {v["host"]: k for k, v in etcd("members/relay/").items()}
    assert set(relays) == {"h2", "h3"}, relays
    reissued_before = prom_sum("rlfleet_env_turns_reissued_total")
    lab_cli("poweroff", "--name", LAB, "h3")
    t0 = time.monotonic()
    wait_for("h3's relay and rollout to leave the job", lambda: not any(
        v.get("host") == "h3" for v in etcd("members/").values() if v.get("role") in ("relay", "rollout")),
        timeout_s=60)
    figures["rollout_host_poweroff_noticed_s"] = round(time.monotonic() - t0, 1)
    advances(20, 240, "with h3 powered off")
    wait_for("the env-host to have re-issued turns", lambda: prom_sum("rlfleet_env_turns_reissued_total")
             > reissued_before, timeout_s=60, every_s=3)
    lab_cli("start", "--name", LAB, "h3", timeout=200)
    wait_for("h3's relay and rollout back", lambda: {v.get("role") for v in etcd("members/").values()
                                                     if v.get("host") == "h3"} >= {"relay", "rollout"},
             timeout_s=240, every_s=2)
    advances(10, 180, "with h3 back")


def test_the_trainer_host_rebooted_resumes_from_its_checkpoint(cluster):
    checkpoint = wait_for("a checkpoint", lambda: int(trainer().get("checkpoint_version") or 0), timeout_s=240)
    at_poweroff = version()
    powered_off_at = time.time()
    lab_cli("poweroff", "--name", LAB, "h1")
    t0 = time.monotonic()
    lab_cli("start", "--name", LAB, "h1", timeout=200)
    # (a lab host shares the kernel's boot id: a process started after the power-off is the new one)
    # ... and resumed: until then its record says version 0 (a loaded machine shows it)
    back = wait_for("the trainer registered again after the reboot, resumed", lambda: (t := trainer()) and
                    float(t.get("started", 0)) > powered_off_at
                    and "version" in t and t.get("training") not in ("starting", "resuming") and t,
                    timeout_s=300, every_s=1)
    assert int(back["version"]) >= checkpoint, (checkpoint, back)  # resumed, not from step 0
    advances(10, 300, "after the trainer host's reboot")
    figures["trainer_reboot_to_training_s"] = round(time.monotonic() - t0, 1)
    figures["trainer_resumed_at_version"] = {"at_poweroff": at_poweroff, "checkpoint": checkpoint,
                                             "first_seen_after_reboot": int(back["version"])}


def test_ended_at_a_step_it_trains_to_it_and_the_accounting_holds(cluster):
    # Far enough ahead that job.yml and the reload land before the trainer gets there
    # (it makes ~5-10 steps a second here; they take ~10 s).
    end = version() + 300
    playbook("job.yml", "-e", f"rlfleet_job_spec={job_spec(cluster, end)}", "-e", "rlfleet_job_replace=true")
    host_sh("h1", f"systemctl reload 'rlfleet@{JOB}:trainer-0.service'")  # ExecReload: SIGHUP, the new max_steps
    wait_for(f"training done at step {end}", lambda: trainer().get("training") == "done", timeout_s=300)
    assert version() == end
    playbook("stop.yml")
    # Every journal of the job, from the hosts' disks, in one run dir on the observer.
    gathered = LAB_HOSTS / OBSERVER / "merged" / "root" / "accounting"
    shutil.rmtree(gathered, ignore_errors=True)
    (gathered / "checkpoints").mkdir(parents=True)
    shutil.copy(LAB_HOSTS / "h1" / "merged" / RUN_DIR.lstrip("/") / "checkpoints" / "journal.bin",
                gathered / "checkpoints")
    shutil.copytree(LAB_HOSTS / "h4" / "merged" / RUN_DIR.lstrip("/") / "env-host", gathered / "env-host")
    proc = host_sh(OBSERVER, with_job_env(f"{RLFLEET} accounting /root/accounting --job {JOB}"), check=False)
    figures["accounting"] = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    evals = [json.loads(line) for line in (LAB_HOSTS / "h1" / "merged" / RUN_DIR.lstrip("/") / "metrics.jsonl")
             .read_text().splitlines() if '"eval_success"' in line]
    figures["eval_success_first_last"] = [evals[0]["eval_success"], evals[-1]["eval_success"]]
    assert evals[-1]["eval_success"] > evals[0]["eval_success"] + 0.25, figures["eval_success_first_last"]


def test_a_stopped_job_stays_stopped_through_a_hosts_reboot(cluster):
    # stop.yml ran above: `rlfleet stop`, then the agents stopped. They stay enabled, so a
    # power-cycled host brings its agent back, which must start nothing of the job.
    assert J.etcd("state")[f"{JobKeys(JOB).prefix}state"]["state"] == "stopped"
    booted_at = time.time()
    lab_cli("poweroff", "--name", LAB, "h2")
    lab_cli("start", "--name", LAB, "h2", timeout=200)
    wait_for("h2's agent back", lambda: float((J.etcd("nodes/h2").get(f"{JobKeys(JOB).prefix}nodes/h2") or {})
                                               .get("seen", 0)) > booted_at, timeout_s=200)
    seen: list[str] = []  # any daemon of the job registered, over ten seconds of the agent's cycles
    watched_from = time.monotonic()

    def ten_seconds_watched() -> bool:
        seen.extend(k for k in J.etcd(f"{MEMBERS}/") if f"/{MEMBERS}/agent/" not in k)
        return time.monotonic() - watched_from >= 10
    wait_for("ten seconds of h2's agent watched", ten_seconds_watched, timeout_s=60, every_s=1)
    assert seen == [], seen
    status = J.rlfleet(f"status --job {JOB}", check=False)
    assert status.returncode == 0 and "STOPPED since" in status.stdout, status.stdout + status.stderr
