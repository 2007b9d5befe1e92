"""What every `rlfleet` command that talks to etcd shares: the --etcd option and the
credential flags, the one place a store is opened, and picking the job.

Kept apart from tools/cli.py so each operator command group (tools/ctl/node.py, ...)
is its own module and imports only this.
"""

from __future__ import annotations

import os
import sys

import click

from rlfleet.common.control.keys import ROOT_PREFIX, job_of
from rlfleet.common.job_name import JOB_NAME_RULE, is_job_name
from rlfleet.tools.exit_codes import Exit

EXIT_ETCD = Exit.ETCD_UNREACHABLE
DEFAULT_ETCD = os.environ.get("RLFLEET_ETCD", "127.0.0.1:2379")

# etcd credentials (docs/operations/security.md): flags, else the environment. Kept in the click
# context rather than passed to every command, so every command that talks to etcd
# takes them and `_store` is the one place that builds the store.
ETCD_CREDENTIAL_FLAGS = (
    ("cacert", "RLFLEET_ETCD_CACERT", "FILE", "CA certificate of etcd's server certificate (turns TLS on)."),
    ("cert", "RLFLEET_ETCD_CERT", "FILE", "Client certificate, for an etcd with --client-cert-auth."),
    ("key", "RLFLEET_ETCD_KEY", "FILE", "Key of the client certificate (mode 0600)."),
    ("user", "RLFLEET_ETCD_USER", "NAME", "etcd user, for an etcd with auth enabled."),
    ("password-file", "RLFLEET_ETCD_PASSWORD_FILE", "FILE", "That user's password, in a file of mode 0600."),
)


def _remember_credential(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    ctx.meta.setdefault("etcd_creds", {})[param.name.removeprefix("etcd_")] = value


def etcd_credential_options(fn):
    for name, var, metavar, text in reversed(ETCD_CREDENTIAL_FLAGS):
        fn = click.option(f"--etcd-{name}", envvar=var, default=None, metavar=metavar, expose_value=False,
                          callback=_remember_credential, help=f"{text} (also ${var})")(fn)
    return fn


def etcd_option(fn):
    fn = etcd_credential_options(fn)
    return click.option("--etcd", "etcd", default=DEFAULT_ETCD, show_default=True, metavar="HOST:PORT[,...]",
                        help="etcd endpoints (also $RLFLEET_ETCD).")(fn)


def _etcd_credentials():
    """The etcd credentials of this command's flags and environment."""
    from rlfleet.common.control.etcd_auth import EtcdCredentials
    try:
        return EtcdCredentials.from_env(**click.get_current_context().meta.get("etcd_creds", {}))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--etcd-*") from None


def _store(endpoints: str, timeout_s: float = 1.0):
    from rlfleet.common.control.etcd_auth import open_store
    creds = _etcd_credentials()
    try:
        return open_store(endpoints, timeout_s=timeout_s, creds=creds)
    except ValueError as exc:  # a bad endpoint, or a credential file refused (mode, missing)
        raise click.BadParameter(str(exc), param_hint="--etcd / --etcd-*") from None


def _fail_unreachable(exc: Exception, endpoints: str) -> None:
    click.echo(f"error: etcd at {endpoints} is unreachable: {exc}", err=True)
    sys.exit(EXIT_ETCD)


def job_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """The callback of every --job: a name no spec could have (`../x`) is a usage error
    (exit 2) before any key or folder is built from it."""
    if value is not None and not is_job_name(value):
        raise click.BadParameter(f"{JOB_NAME_RULE}, got {value!r}")
    return value


def _pick_job(store, job: str | None) -> str:
    if job:
        return job
    jobs = sorted({job for job in (job_of(kv.key) for kv in store.get_prefix(ROOT_PREFIX)) if job})
    if len(jobs) != 1:
        raise click.UsageError(f"--job is required: etcd holds {len(jobs)} jobs ({', '.join(jobs) or 'none'})")
    return jobs[0]


