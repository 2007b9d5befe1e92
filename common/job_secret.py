"""The per-job secret that authenticates the relay's chunk transport (relay/auth.py).

The secret is the contents of a file named by ``RLFLEET_JOB_SECRET_FILE``; unset
means authentication is off (every peer that can reach a relay's chunk port is
trusted, which was the only behaviour before). The file must be readable by its
owner only: a secret that every user of the machine can read authenticates
nobody, so a group- or world-accessible file is refused rather than used.
"""

from __future__ import annotations

import os

from rlfleet.common.secret_files import SecretFileError, read_private

ENV_VAR = "RLFLEET_JOB_SECRET_FILE"
MIN_BYTES = 16  # 128 bits: below that an HMAC key is guessable offline from one recorded handshake


class JobSecretError(SecretFileError):
    """The secret file cannot be used (names the path and why)."""


def load_job_secret(path: str | os.PathLike[str]) -> bytes:
    """The secret in ``path`` (surrounding whitespace stripped); refuses loose permissions
    and a symlink (the file itself must be the owner's)."""
    path = os.fspath(path)
    try:
        secret = read_private(path, "job secret file", follow_symlinks=False).strip()
    except SecretFileError as exc:
        raise JobSecretError(str(exc)) from None
    if len(secret) < MIN_BYTES:
        raise JobSecretError(f"job secret file {path}: {len(secret)} bytes; at least {MIN_BYTES} are needed "
                             "(e.g. head -c 32 /dev/urandom | base64 > FILE)")
    return secret


def job_secret_from_env() -> bytes | None:
    """The secret named by RLFLEET_JOB_SECRET_FILE, or None when the variable is unset or empty."""
    path = os.environ.get(ENV_VAR, "")
    return load_job_secret(path) if path else None
