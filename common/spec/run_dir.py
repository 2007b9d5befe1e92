"""Where a job's files go on this machine (journals, checkpoints, metrics, stats).

`rlfleet run` gives every daemon its run's folder in $RLFLEET_RUN_DIR
(runs/<job>/<timestamp>/); a daemon started by systemd or by hand uses
<job.runs_dir>/<job>. One rule, so the trainer, env-hosts and repack-manager of
one run always write beside each other.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlfleet.common.spec.job import JobSpec

ENV_VAR = "RLFLEET_RUN_DIR"


def job_run_dir(spec: JobSpec) -> Path:
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else Path(spec.job.runs_dir) / spec.job.name
