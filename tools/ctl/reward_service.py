"""`rlfleet reward-service`: one reward pipeline shared by several jobs' reward-hosts
(daemons/reward_host/shared/service.py; docs/design/reward.md "Shared reward service").

Its own command, not `rlfleet daemon ROLE`: a daemon belongs to one job (its `--job`,
its registration and spec under that job's prefix in etcd), while this service belongs
to none. Its callers find it by the URL in their `[reward_host.backend]`, as they find
any remote endpoint, and it needs no etcd.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import click

from rlfleet.tools.exit_codes import Exit


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not sep or not host or not 0 <= number <= 65535:
        raise click.BadParameter(f"expected HOST:PORT with a port in 0..65535, got {value!r}")
    return host.strip("[]"), number


@click.command("reward-service")
@click.option("--spec", "spec_file", required=True, type=click.Path(dir_okay=False),
              help="The service's spec (TOML: [service], [pipeline] with its [[pipeline.stages]]).")
@click.option("--listen", default="127.0.0.1:8800", show_default=True, metavar="HOST:PORT",
              help="Where to serve POST /score (port 0: any free port; the URL is printed). "
                   "Without the spec's [tls]: a loopback address only.")
@click.option("--check", is_flag=True, help="Validate the spec and exit (like `rlfleet job validate`).")
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
def reward_service(spec_file: str, listen: str, check: bool, log_level: str) -> None:
    """Serve a reward pipeline to several jobs: each job's reward-host points its
    remote_http backend at https://HOST:PORT/score (the spec's [tls]; without it, plain
    http:// on a loopback address only)."""
    from rlfleet.common.spec.errors import SpecError
    from rlfleet.daemons.reward_host.shared.spec import listen_refusal, load_service_spec

    host, port = _listen(listen)
    try:
        spec = load_service_spec(spec_file)
    except SpecError as exc:
        click.echo(str(exc), err=True)
        sys.exit(Exit.BAD_SPEC)
    if why := listen_refusal(spec, host):
        click.echo(why, err=True)
        sys.exit(Exit.BAD_SPEC)
    stages = ", ".join(s.name for s in spec.pipeline.stages)
    if check:
        tls = "" if spec.tls is None else "; https" + (", client certificates" if spec.tls.client_ca_file else "")
        click.echo(f"{spec_file}: ok ({len(spec.pipeline.stages)} stages: {stages}; queue "
                   f"{spec.pipeline.queue}, scaling {spec.pipeline.scaling}{tls})")
        return

    from rlfleet.common.logs import setup_json_logging
    from rlfleet.daemons.reward_host.shared.answer_journal import JournalUnusable
    from rlfleet.daemons.reward_host.shared.service import serve

    setup_json_logging(log_level, role="reward-service", id=f"reward-service-{os.getpid()}")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        summary = serve(spec, host, port, stop,
                        on_listening=lambda url: click.echo(f"listening on {url}"))  # echo flushes
    except ValueError as exc:  # an unreadable auth_secret_file, a [tls] file changed since validation
        click.echo(str(exc), err=True)
        sys.exit(Exit.BAD_SPEC)
    except JournalUnusable as exc:  # taken by another service, or not writable
        click.echo(str(exc), err=True)
        sys.exit(Exit.FAILURE)
    except OSError as exc:  # the address is taken or not ours
        click.echo(f"--listen {listen}: {exc.strerror or exc}", err=True)
        sys.exit(Exit.FAILURE)
    click.echo(f"reward service stopped: {summary}", err=True)
