"""A daemon's start against the job's `[security]` section (docs/operations/security.md): turn on
CURVE from the keys it finds, and refuse to run without what the job requires, so a
daemon started without its keys stops with one clear line instead of running in the
clear (where its peers would refuse it anyway, in silence).
"""

from __future__ import annotations

import os

from rlfleet.common.job_secret import ENV_VAR as JOB_SECRET_ENV  # the relay's chunk transport reads it
from rlfleet.common.secret_files import SecretFileError
from rlfleet.common.spec.job import JobSpec
from rlfleet.common.spec.placement import ROLES
from rlfleet.common.wire import curve, edges

# Who speaks the relay's chunk transport: relays, and the trainer that pushes to the master.
RELAY_AUTH_ROLES = ("relay", "trainer")


class SecurityError(RuntimeError):
    """This daemon lacks what the job requires; the message says what to provide."""


def enforce(spec: JobSpec, role: str) -> str:
    """CURVE on when keys are found ($RLFLEET_CURVE_DIR, else security.curve_dir); the job
    secret's path exported for the relay's code; SecurityError when the job requires
    something this process does not have. Returns a sentence for the log ("" if nothing)."""
    sec = spec.security
    said = []
    zmq_role = role in ROLES  # a node agent speaks no ZeroMQ and has no role key
    if zmq_role and curve.active() is None:
        try:
            setup = curve.configure_from_env(sec.curve_dir, role)
        except (curve.CurveError, SecretFileError, OSError) as exc:
            raise SecurityError(f"CURVE keys unusable: {exc}") from None
        if setup is not None:
            speaks_for = setup.roles.get(setup.public)
            if role in edges.SENDERS and speaks_for != role:
                # It sends on an edge that admits only its role: every peer would refuse it.
                curve.configure(None)
                where = "nowhere" if speaks_for is None else f"for {speaks_for}" if speaks_for else "without a role"
                raise SecurityError(f"CURVE: this {role}'s key {setup.public.decode()} is authorized {where} "
                                    f"in {setup.directory}, so its peers would refuse it: make the role's own pair "
                                    f"with `rlfleet curve-keys DIR --role {role}` (docs/operations/security.md)")
            said.append(f"CURVE on: public key {setup.public.decode()} ({role}), {len(setup.authorized)} "
                        f"authorized client key(s) in {setup.directory}")
    if zmq_role and sec.curve and curve.active() is None:
        raise SecurityError("the job requires CURVE ([security] curve = true) and this daemon has no keys: "
                            f"set ${curve.ENV_DIR} or [security] curve_dir (docs/operations/security.md)")
    if sec.job_secret_file and not os.environ.get(JOB_SECRET_ENV):
        os.environ[JOB_SECRET_ENV] = sec.job_secret_file  # where job_secret_from_env() looks
    if sec.relay_auth and role in RELAY_AUTH_ROLES and not os.environ.get(JOB_SECRET_ENV):
        raise SecurityError("the job requires an authenticated relay transport ([security] relay_auth = true) "
                            f"and this daemon has no job secret: set ${JOB_SECRET_ENV} or "
                            "[security] job_secret_file (docs/operations/security.md)")
    return "; ".join(said)
