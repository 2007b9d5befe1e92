"""Adding (and draining) a machine in a live job, on a lab of six systemd hosts.

    python -m rlfleet.tools.bench.node_add --json OUT [--plot OUT.png] [--drain]

Brings up a lab (tools/lab, docs/operations/lab.md; root, the lab's rootfs and wheelhouse built:
`make test-deploy` does both), provisions five hosts with `site.yml`, submits the
cluster example and waits for training; then starts `rlfleet node add h6` on an
observer host and provisions h6 (`site.yml -l h6:prometheus`): node add prints and
writes each phase from h6's agent registration — admit, place, start, weights,
first_trajectory (docs/operations/live-fleet.md). With --drain it then drains h6 (`rlfleet node
drain h6`), ends the job at a step, and counts lost trajectories over every host's
journals (`rlfleet accounting`: claimed − trained − dropped − in flight).

Writes {"phases": {...}, "total_s", "lost_trajectories", "provision_s", ...} (with
--drain also {"drain": {"drain_s", "lost_trajectories"}}) and a bar plot of the phases.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlfleet.tools.lab.job import ANSIBLE, JOB, LAB_CMD, RLFLEET, RUN_DIR, LabJob, job_spec, wait_for, with_job_env

LAB, SUBNET, HOSTS, NEW, OBSERVER = "bench-node", "10.215.0", 6, "h6", "h5"


def lab(*args: str, timeout: float = 400) -> None:
    import subprocess
    proc = subprocess.run([*LAB_CMD, *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"lab {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")


def add_host(j: LabJob, extra_inventory: Path, limit: str = f"{NEW}:prometheus") -> dict[str, Any]:
    """Start `node add` on the observer, then provision the new host (`site.yml -l LIMIT`)."""
    j.host_sh(OBSERVER, f"rm -f /root/add.json; setsid nohup bash -c '{with_job_env(RLFLEET)} node add {NEW} "
                        "--timeout 600 --json /root/add.json > /root/add.log 2>&1' > /dev/null 2>&1 < /dev/null &")
    t0 = time.monotonic()
    _, provision_s = j.playbook("site.yml", "-l", limit, inventories=(str(extra_inventory),))
    raw = wait_for("rlfleet node add to finish", lambda: j.host_sh(OBSERVER, "cat /root/add.json", check=False)
                   .stdout.strip() or None, timeout_s=600, every_s=2)
    print(j.host_sh(OBSERVER, "cat /root/add.log").stdout, flush=True)
    return {**json.loads(raw), "provision_s": round(provision_s, 1),
            "provision_to_first_trajectory_s": round(time.monotonic() - t0, 1)}


def lost_after_end(j: LabJob, tmp: Path, inventories: tuple[str, ...] = ()) -> int:
    """End the job at a step, stop it, and count lost trajectories over every host's journals."""
    end = j.version() + 100
    j.playbook("job.yml", "-e", f"rlfleet_job_spec={job_spec(tmp, end)}", "-e", "rlfleet_job_replace=true")
    j.host_sh("h1", f"systemctl reload 'rlfleet@{JOB}:trainer-0.service'")
    wait_for(f"training done at step {end}", lambda: j.trainer().get("training") == "done", timeout_s=600)
    j.playbook("stop.yml", inventories=inventories)
    root = Path(os.environ.get("RLFLEET_LAB_ROOT", "/var/lib/rlfleet-lab")) / j.lab / "hosts"
    gathered = root / OBSERVER / "merged" / "root" / "accounting"
    shutil.rmtree(gathered, ignore_errors=True)
    (gathered / "checkpoints").mkdir(parents=True)
    shutil.copy(root / "h1" / "merged" / RUN_DIR.lstrip("/") / "checkpoints" / "journal.bin", gathered / "checkpoints")
    shutil.copytree(root / "h4" / "merged" / RUN_DIR.lstrip("/") / "env-host", gathered / "env-host")
    out = j.rlfleet(f"accounting /root/accounting --job {JOB}", check=False).stdout
    print(out, flush=True)
    return int(json.loads(out)["lost_total"])


def plot(record: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    phases = {k.removesuffix("_s"): v or 0.0 for k, v in record["phases"].items()}
    fig, ax = plt.subplots(figsize=(7, 2.6))
    left = 0.0
    for name, seconds in phases.items():
        ax.barh(["node add"], [seconds], left=left, label=f"{name} {seconds:.1f} s")
        left += seconds
    ax.axvline(60, color="red", linestyle="--", label="target 60 s")
    ax.set_xlabel("seconds from the agent's registration")
    ax.set_title(f"a host joining a live job (lab, 2 cores): {record['total_s']:.1f} s to its first trajectory")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--drain", action="store_true", help="then drain the new host and count lost trajectories")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("node_add: the lab needs root", file=sys.stderr)
        return 2
    j = LabJob(LAB, HOSTS, OBSERVER)
    tmp = Path(tempfile.mkdtemp(prefix="node-add-"))
    extra = tmp / "h6.ini"
    extra.write_text(f'[cluster]\n{NEW} rlfleet_labels="roles=rollout,relay;cpu=x86"\n')
    shutil.rmtree(ANSIBLE / "pki", ignore_errors=True)
    lab("up", "--name", LAB, "--hosts", str(HOSTS), "--subnet", SUBNET, "--timeout", "240")
    try:
        j.playbook("site.yml", "-l", ":".join(f"h{i}" for i in range(1, HOSTS)), inventories=(str(extra),))
        j.playbook("job.yml", "-e", f"rlfleet_job_spec={job_spec(tmp, 1_000_000)}")
        wait_for("the first training step", lambda: j.version() >= 1, timeout_s=300)
        record = add_host(j, extra)
        if args.drain:
            t0 = time.monotonic()
            out = j.rlfleet(f"node drain {NEW} --timeout 300", timeout=360).stdout
            print(out, flush=True)
            drain_s = round(time.monotonic() - t0, 1)
            lost = lost_after_end(j, tmp)
            record["drain"] = {"drain_s": drain_s, "lost_trajectories": lost}
        record["lost_trajectories"] = lost_after_end(j, tmp) if not args.drain else record["drain"]["lost_trajectories"]
        record["machine"] = "lab of 6 systemd-nspawn hosts on one 2-core VM"
    finally:
        lab("down", "--name", LAB)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    if args.plot:
        plot(record, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
