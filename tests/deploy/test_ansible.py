"""ansible/ without a cluster: the playbooks parse, the inventories place daemons where the
cluster spec does, the templates render to what etcd and Prometheus expect, and the
Grafana dashboard asks only for metrics that something exports.

Tests that need ansible-core (`pip install -e '.[deploy]'`) skip without it; running the
playbooks for real is the lab's test (tools/lab).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlfleet.common.spec.job import load_spec
from rlfleet.tools.cli import main

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "ansible"
CLUSTER_SPEC = REPO / "examples" / "cluster-arithmetic.toml"
INVENTORIES = ["inventory.example.ini", "inventory.lab.ini"]
PLAYBOOKS = sorted(p.name for p in ANSIBLE.glob("*.yml"))
# Spec role -> the inventory group whose hosts run it.
ROLE_GROUPS = {"trainer": "trainer", "rollout": "rollout", "relay": "rollout", "env-host": "env",
               "reward-host": "reward", "resource-manager": "managers", "repack-manager": "managers"}


def tool(name: str) -> str | None:
    """A command of this Python's environment (the venv's ansible), else from PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def ansible(name: str, *args: str, cwd: Path = ANSIBLE) -> subprocess.CompletedProcess:
    exe = tool(name)
    if exe is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[deploy]')")
    env = {**os.environ, "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    done = subprocess.run([exe, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{name} {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_playbook_syntax(playbook):
    ansible("ansible-playbook", "--syntax-check", "-i", "inventory.example.ini", playbook)


def test_every_playbook_is_checked():
    assert set(PLAYBOOKS) >= {"site.yml", "job.yml", "stop.yml"}


def test_a_run_lists_its_slowest_tasks_after_the_recap(tmp_path):
    """ansible.cfg enables callback_plugins/task_timing.py: a real playbook on localhost ends
    with its tasks by wall time, slowest first, which the lab test records (tools/lab/job.py)."""
    from rlfleet.tools.lab.job import task_timing

    play = tmp_path / "timed.yml"
    play.write_text("- hosts: localhost\n  gather_facts: false\n  tasks:\n"
                    "    - {name: quick, ansible.builtin.command: 'true'}\n"
                    "    - {name: slow, ansible.builtin.command: sleep 1}\n")
    out = ansible("ansible-playbook", "-i", "localhost,", "-c", "local", "-e",
                  f"ansible_python_interpreter={sys.executable}", str(play)).stdout
    assert out.index("PLAY RECAP") < out.index("TASK TIMING:")
    timed = task_timing(out)
    # Slowest first, whatever the load (a busy machine can make the module run of `true`
    # outlast `sleep 1`'s: only the order of what was measured is asserted).
    assert sorted(name for _, name in timed) == ["quick", "slow"], out[-2000:]
    assert [t for t, _ in timed] == sorted((t for t, _ in timed), reverse=True), timed
    assert dict((name, t) for t, name in timed)["slow"] >= 1.0


def inventory(name: str) -> dict:
    return json.loads(ansible("ansible-inventory", "-i", name, "--list").stdout)


def group(inv: dict, name: str) -> set[str]:
    return set(inv.get(name, {}).get("hosts", []))


@pytest.mark.parametrize("name", INVENTORIES)
def test_inventory_places_what_the_cluster_spec_places(name):
    inv = inventory(name)
    spec = load_spec(CLUSTER_SPEC)
    assert len(group(inv, "etcd")) == 3  # one member may fail
    assert group(inv, "etcd") <= group(inv, "cluster")
    for h in spec.placement.hosts:
        assert h.name in group(inv, "cluster"), f"{h.name}: placed by the spec, not in the inventory"
        labels = inv["_meta"]["hostvars"][h.name]["rlfleet_labels"]
        allowed = dict(kv.split("=", 1) for kv in labels.split(";"))["roles"].split(",")
        for role in spec.roles_on(h.name):
            assert h.name in group(inv, ROLE_GROUPS[role]), f"{role} on {h.name}, not in [{ROLE_GROUPS[role]}]"
            assert role in allowed, f"{h.name}: labels {labels!r} do not allow {role}"
    for role, grp in ROLE_GROUPS.items():
        placed = {h.name for h in spec.placement.hosts if spec.roles_on(h.name).get(role)}
        assert placed <= group(inv, grp)


def test_the_inventories_have_the_same_groups():
    a, b = (inventory(n) for n in INVENTORIES)
    for name in ("cluster", "etcd", "trainer", "rollout", "env", "reward", "managers", "prometheus"):
        assert group(a, name) == group(b, name), name


def render(template: str, host: str, tmp_path: Path, inventory: str = "inventory.example.ini") -> str:
    """One role template rendered for ``host`` of an inventory (in ansible/), on this machine,
    by a play that loads the settings as every play of the playbooks does (cluster_defaults)."""
    out = tmp_path / (Path(template).stem + "." + host)
    play = tmp_path / "render.yml"
    play.write_text(json.dumps([{"hosts": host, "gather_facts": False, "roles": ["cluster_defaults"],
                                 "tasks": [{"ansible.builtin.template": {"src": str(ANSIBLE / template),
                                                                        "dest": str(out)}}]}]))
    ansible("ansible-playbook", "-i", inventory, "-c", "local", "-e", "ansible_python_interpreter=" + sys.executable,
            str(play))
    return out.read_text()


def test_an_inventorys_all_vars_override_the_settings(tmp_path):
    """The documented way: `rlfleet_job` in the inventory's [all:vars] is the job every
    host's env file names (as the playbooks' group_vars/all.yml the default won)."""
    inventory = ANSIBLE / f".inventory-all-vars-{os.getpid()}.ini"  # beside the others, as a user's is
    inventory.write_text((ANSIBLE / "inventory.example.ini").read_text() + "\n[all:vars]\nrlfleet_job=drill\n")
    try:
        text = render("roles/rlfleet/templates/job.env.j2", "h3", tmp_path, inventory.name)
    finally:
        inventory.unlink()
    assert 'RLFLEET_JOB="drill"' in text or "RLFLEET_JOB=drill" in text, text
    assert "/var/lib/rlfleet/drill" in text, text


def test_etcd_member_configuration(tmp_path):
    text = render("roles/etcd/templates/etcd.env.j2", "h2", tmp_path)
    env = dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert env["ETCD_NAME"] == "h2"
    assert env["ETCD_INITIAL_CLUSTER"] == ",".join(f"h{i}=https://10.0.0.{i}:2380" for i in (1, 2, 3))
    assert env["ETCD_ADVERTISE_CLIENT_URLS"] == "https://10.0.0.2:2379"
    assert env["ETCD_CLIENT_CERT_AUTH"] == env["ETCD_PEER_CLIENT_CERT_AUTH"] == "true"
    assert env["ETCD_LISTEN_METRICS_URLS"] == "http://10.0.0.2:2381"
    assert all(k.startswith("ETCD_") for k in env)


def test_job_env_file(tmp_path):
    text = render("roles/rlfleet/templates/job.env.j2", "h3", tmp_path)
    env = {k: v.strip('"') for k, v in (line.split("=", 1) for line in text.splitlines()
                                        if line and not line.startswith("#"))}
    assert env["RLFLEET_JOB"] == load_spec(CLUSTER_SPEC).job.name
    assert env["RLFLEET_ETCD"] == "10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379"
    assert (env["RLFLEET_HOST"], env["RLFLEET_BIND_HOST"], env["RLFLEET_METRICS_HOST"]) == ("h3", "10.0.0.3", "10.0.0.3")
    assert env["RLFLEET_RUN_DIR"] == "/var/lib/rlfleet/arith"
    assert env["RLFLEET_CURVE_DIR"] == "/etc/rlfleet/jobs/arith/curve"
    assert env["RLFLEET_LABELS"] == "roles=rollout,relay;cpu=x86"
    # The same file is sourced by `sh` in job.yml: it must mean the same there.
    shown = subprocess.run(["sh", "-c", f"set -a; . {tmp_path / 'job.env.h3'}; env"], capture_output=True,
                           text=True, check=True, env={}).stdout
    assert f"RLFLEET_LABELS={env['RLFLEET_LABELS']}\n" in shown


def test_prometheus_configuration(tmp_path):
    yaml = pytest.importorskip("yaml")  # comes with ansible-core
    text = render("roles/prometheus/templates/prometheus.yml.j2", "h5", tmp_path)
    jobs = {j["job_name"]: j for j in yaml.safe_load(text)["scrape_configs"]}
    hosts = [f"10.0.0.{i}" for i in range(1, 6)]
    assert [t for sc in jobs["rlfleet-agents"]["static_configs"] for t in sc["targets"]] == [f"{h}:9464" for h in hosts]
    assert [sd["url"] for sd in jobs["rlfleet-daemons"]["http_sd_configs"]] == [f"http://{h}:9464/targets" for h in hosts]
    assert [t for sc in jobs["etcd"]["static_configs"] for t in sc["targets"]] == [f"{h}:2381" for h in hosts[:3]]


# Debian's promtool: on PATH where prometheus is installed, else the lab's base rootfs has it.
LAB_PROMTOOL = "/var/cache/rlfleet-lab/rootfs/usr/bin/promtool"
PROMTOOL = shutil.which("promtool") or (LAB_PROMTOOL if os.access(LAB_PROMTOOL, os.X_OK) else None)


@pytest.mark.skipif(PROMTOOL is None, reason="no promtool (apt-get install prometheus, or build the lab's rootfs)")
def test_promtool_accepts_the_prometheus_configuration(tmp_path):
    render("roles/prometheus/templates/prometheus.yml.j2", "h5", tmp_path)
    done = subprocess.run([PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml.h5")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ansible_lint():
    lint = tool("ansible-lint")
    if lint is None:
        pytest.skip("ansible-lint is not installed (optional)")
    done = subprocess.run([lint, "--offline"], cwd=ANSIBLE, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


# -- the dashboard --------------------------------------------------------------------------
# Exported by something other than rlfleet's code: Prometheus itself (up), prometheus_client's
# process collector in every daemon (process_*), etcd's members (etcd_*).
EXTERNAL = re.compile(r"^(up|process_[a-z_]+|etcd_[a-z_]+)$")
PROMQL_WORDS = {"sum", "max", "min", "avg", "by", "without", "rate", "increase", "changes",
                "histogram_quantile", "le", "on", "ignoring", "offset", "bool", "and", "or", "unless"}


def exported_metrics() -> set[str]:
    """Every metric name rlfleet's code defines, with the series names Prometheus sees."""
    names: set[str] = set()
    pattern = re.compile(r"(Gauge|Counter|Histogram|Summary|Info|Enum)\(\s*\"([a-z_:][a-z0-9_:]*)\"")
    for py in REPO.glob("*/**/*.py"):
        if py.parts[len(REPO.parts)] in ("tests", ".venv", "build"):
            continue
        for kind, name in pattern.findall(py.read_text(errors="replace")):
            names.add(name)
            if kind in ("Histogram", "Summary"):
                names |= {name + s for s in ("_bucket", "_sum", "_count", "_created")}
    return names


def dashboard_metrics() -> set[str]:
    board = json.loads((ANSIBLE / "files" / "grafana" / "rlfleet.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert exprs, "the dashboard has no queries"
    names = set()
    for expr in exprs:
        # label selectors, ranges, strings and grouping clauses name labels, not metrics
        bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"|\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
        names |= {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare)
                  if w not in PROMQL_WORDS and not w.isdigit()}
    return names


def test_every_dashboard_metric_exists():
    exported = exported_metrics()
    assert "rlfleet_up" in exported and "rlfleet_trainer_step" in exported  # the scan finds them
    missing = {m for m in dashboard_metrics() - exported if not EXTERNAL.match(m)}
    assert not missing, f"the dashboard asks for metrics nothing exports: {sorted(missing)}"


def test_the_dashboard_shows_the_main_figures():
    shown = dashboard_metrics()
    for figure in ("rlfleet_trainer_step", "rlfleet_trainer_reward_mean", "rlfleet_trainer_tokens_total",
                   "rlfleet_trainer_staleness_mean", "rlfleet_rejected_messages_total",
                   "process_start_time_seconds", "rlfleet_is_leader", "rlfleet_up", "up"):
        assert figure in shown, figure


# -- the example cluster spec ---------------------------------------------------------------
def test_the_cluster_spec_validates():
    result = CliRunner().invoke(main, ["job", "validate", str(CLUSTER_SPEC)])
    assert result.exit_code == 0, result.output
    spec = load_spec(CLUSTER_SPEC)
    assert spec.security.curve and spec.security.relay_auth
    relay_hosts = [h.name for h in spec.placement.hosts if spec.roles_on(h.name).get("relay")]
    assert len(relay_hosts) == 2 and all(spec.roles_on(h).get("rollout") for h in relay_hosts)
