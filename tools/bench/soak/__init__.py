"""Soak (issue 28): two jobs side by side for hours under faults, on one shared etcd.

    python -m rlfleet.tools.bench.soak --hours 2 --json runs/bench/soak.json

Run it from a clone with a virtual environment of its own (``make setup`` in the clone):
its daemons are restarted for hours from the installed package, and an editable install
shared with a working tree that changes meanwhile (a ``pip install -e .`` rewrites the
entry points) breaks the restarted ones (soak-void-20261127.json).

Runs examples/longtail-sim.toml (64 simulated rollouts in one process, the sim trainer)
and examples/arithmetic.toml (the tiny real model) at the same time, each as
``rlfleet run <spec> --no-view --duration <hours> --etcd <endpoints>`` (max_steps lifted so
only the duration ends them; job names ``<name>-soak``), against one 3-member etcd this
bench starts (loopback, 100 ms heartbeat / 1 s election like `rlfleet run`'s own etcd: the
machine is loaded). Both jobs' runs_dir is a tmpfs the bench mounts (``--tmpfs-mib``).

Faults, on a schedule from the start (``fault_schedule``; none in the last ``--quiet-end-s``,
so the jobs end and check their accounting on a whole etcd and a free disk):
  - kill -9 of a random daemon process of either job, every ``--kill-every-min``: picked
    among the processes the jobs' ``members/<role>/<id>`` records name (a pid hosting many
    members, the 64 sim rollouts, is one process); `rlfleet run` restarts it;
  - kill -9 of a random etcd member every ``--etcd-loss-every-min`` (+20 s), started
    again after ``--etcd-down-s``;
  - a full disk every ``--disk-full-every-min`` (+40 s): a filler file takes the tmpfs
    until it refuses (topped up while it lasts) for ``--disk-full-s``, then is removed.

Every ``--sample-s``: per daemon process (both jobs, found by its member records, keyed
job/member/pid; each `rlfleet run` too, as ``rlfleet-run``) VmRSS, open fds and the RSS of
it with its children (reward workers); per job the trainer's last step, the drop totals
and consumed groups of metrics.jsonl and whether its `rlfleet run` still runs; one
progress line. At the end (or Ctrl-C / SIGTERM: both jobs are stopped with SIGTERM and
the record is still written) each job's accounting.json and summary.json are read.

Verdicts, fixed before measuring:
  1. accounting: both runs ended by their duration or a stop (exit 0 or 7) and their
     accounting.json says ok.
  2. no growth: for each process series (a new pid after a restart starts a new series)
     and each of VmRSS, open fds and the RSS with children, the median over the final
     window is at most 10% above the median over the baseline window. w = 15 min (a
     quarter of the run when that is less: trials). A series that lived through both the
     run's baseline window [w, 2w) and its final window (the last w) is judged on them.
     A shorter one (a daemon restarted by a kill) that lived at least 3w is judged on its
     own life: [its start + w, + 2w) against its last w. A series that lived less is not
     judged; the record lists it as short, and says per member how many series were judged.
  3. drop share of arithmetic at most 3% over the run: (staleness + buffer_full drops) /
     prompts claimed, from accounting.json, as tools/bench/drops.py computes it.

Imitates no paper setting: an operations soak. What it does not cover: a whole-machine
loss, etcd's own disk filling (etcd's data is not on the tmpfs), a network partition.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]   # the repository root (the rlfleet package)
