"""Fillers of docs/results/cluster.md, from the records the lab's cluster test writes
(tests/deploy/test_cluster_job.py through module_lab: runs/deploy/cluster.json, committed
as tools/bench/results/cluster-<date>.json): one column per run."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from rlfleet.tools.bench.pages import PageError, Records, filler


def _s(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f} s"


def _changed(recap: dict[str, dict[str, int]] | None) -> str:
    if not recap:
        return "–"
    changed = {h: r["changed"] for h, r in recap.items()}
    return "changed=0 on every host" if not any(changed.values()) else f"changed: {changed}"


def _resumed(r: dict[str, Any]) -> str:
    at = r.get("trainer_resumed_at_version")
    if not at:
        return _s(r.get("trainer_reboot_to_training_s"))
    return (f"{_s(r.get('trainer_reboot_to_training_s'))}; power-off at step {at['at_poweroff']}, "
            f"checkpoint {at['checkpoint']}")


def _accounting(r: dict[str, Any]) -> str:
    a = r.get("accounting")
    if not isinstance(a, dict):
        return "–" if a is None else "not checked"
    return (f"{a['claimed']:,} = {a['trained']:,} + {a['dropped_total']:,} + {a['in_flight']:,}, "
            f"{a['lost_total']} lost" + ("" if a["ok"] else " (**broken**)"))


def _memory(r: dict[str, Any]) -> str:
    m = r.get("memory_per_host_while_training_mib")
    return " / ".join(f"{m[h]:.0f}" for h in sorted(m)) + " MiB" if m else "–"


def _targets(r: dict[str, Any]) -> str:
    t = r.get("prometheus_targets_up")
    if not t:
        return "–"
    return (f"{t.get('rlfleet-agents', 0)} agents, {t.get('rlfleet-daemons', 0)} daemons, {t.get('etcd', 0)} etcd, "
            f"{t.get('prometheus', 0)} itself")


def _evals(r: dict[str, Any]) -> str:
    e = r.get("eval_success_first_last")
    return f"{e[0]:.2f} → {e[1]:.2f}" if e else "–"


TWICE = re.compile(r"^(\S+) : \1 : ")  # records before 9eb5ff6 name a role's task with its role twice


def _slowest(r: dict[str, Any]) -> str:
    tasks = r.get("site_yml_first_slowest_tasks")
    once = [(seconds, TWICE.sub(r"\1 : ", name)) for seconds, name in tasks or []]
    return "; ".join(f"{name} {seconds:.0f} s" for seconds, name in once[:3]) or "–"


ROWS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("`site.yml` on 5 bare hosts (etcd TLS cluster, 5 venvs from the wheelhouse, units, agents, Prometheus)",
     lambda r: _s(r.get("site_yml_first_s"))),
    ("its slowest tasks (wall time, all hosts)", _slowest),
    ("`site.yml` again", lambda r: f"{_s(r.get('site_yml_rerun_s'))}, {_changed(r.get('site_yml_rerun_recap'))}"),
    ("`job.yml` to the first training step", lambda r: _s(r.get("submit_to_first_step_s"))),
    ("memory per lab host while training (PSS of all its processes), h1 … h5", _memory),
    ("Prometheus targets up", _targets),
    ("a stalled main loop → killed by systemd's watchdog and active again (`WatchdogSec=30s`)",
     lambda r: _s(r.get("watchdog_stall_to_restart_s"))),
    ("a powered-off rollout host's relay and rollout gone from etcd (lease 3 s)",
     lambda r: _s(r.get("rollout_host_poweroff_noticed_s"))),
    ("trainer host powered off → training again; where it resumed", _resumed),
    ("accounting after the faults (claimed = trained + dropped + in flight)", _accounting),
    ("held-out success, first → last", _evals),
)


@filler
def cluster_table(record: Records, *files: str) -> str:
    """One column per record (a run of the lab's cluster test), one row per figure."""
    if not files:
        raise PageError("cluster_table: name at least one record")
    runs = [record(f) for f in files]
    head = "| what | " + " | ".join(f"{r['date'][:10]} at `{r['commit'][:10]}`" + (" (a test failed)" if
                                                                               r.get("tests_failed") else "")
                                  for r in runs) + " |"
    rows = [head, "|---|" + "---|" * len(runs)]
    rows += [f"| {label} | " + " | ".join(cell(r) for r in runs) + " |" for label, cell in ROWS]
    return "\n".join(rows)
