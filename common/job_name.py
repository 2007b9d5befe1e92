"""A job's name: the spec's job.name and every command's --job.

Stricter than an etcd key component: it is also a folder (runs_dir/<job>) and part of
unit and member names. The spec checks it (common/spec/job.py) and so does every key
of the job (common/control/keys.py).
"""

from __future__ import annotations

import re

_JOB_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
JOB_NAME_RULE = ("must be 1-63 lowercase letters, digits or '-', starting with a letter or digit "
                 "(it is an etcd key component)")


def is_job_name(name: str) -> bool:
    """Whether ``name`` may name a job (JOB_NAME_RULE says what that takes)."""
    return bool(_JOB_NAME.match(name))
