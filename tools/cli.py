"""The `rlfleet` command: daemons, the embedded fleet, and operator tools.

Thin on purpose (STYLE §9): nothing heavy is imported before the arguments
and the spec are validated, so `--help` and config errors are instant.

Exit codes are defined in tools/exit_codes.py: 0 ok, 1 failure, 2 bad usage / bad
spec (click's own), 3 etcd unreachable, and `rlfleet run`'s own outcomes 4–8.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from pathlib import Path

import click

from rlfleet.common import failpoints
from rlfleet.common.control.keys import ROOT_PREFIX
from rlfleet.common.spec.errors import SpecError
from rlfleet.common.spec.job import load_spec
from rlfleet.common.spec.placement import ROLES
from rlfleet.daemons import NODE_DAEMON_CLASSES
from rlfleet.tools.ctl.etcd_options import (
    _etcd_credentials,
    _fail_unreachable,
    _pick_job,
    _store,
    etcd_credential_options,
    etcd_option,
    job_name,
)
from rlfleet.tools.exit_codes import RUN_CODES, Exit

EXIT_SPEC = Exit.BAD_SPEC
EXIT_ETCD = Exit.ETCD_UNREACHABLE
@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """rlfleet: asynchronous RL post-training on a fleet of machines."""


# -- daemons ------------------------------------------------------------------------
@main.command()
@click.argument("role", type=click.Choice([*ROLES, *NODE_DAEMON_CLASSES]))
@click.option("--job", callback=job_name, required=True,
              help=f"Job name (the {ROOT_PREFIX}<job>/ prefix in etcd).")
@etcd_option
@click.option("--id", "member_id", default=None, help="Member id; default <host>-<role>-<pid>.")
@click.option("--host", default=socket.gethostname(), show_default=True, envvar="RLFLEET_HOST",
              help="Host name this daemon reports (also $RLFLEET_HOST).")
@click.option("--spec", "spec_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Read the spec from this file instead of etcd.")
@click.option("--bind-host", default=None, envvar="RLFLEET_BIND_HOST", metavar="ADDRESS",
              help="Replaces every bind_host of the spec: this host's address on the cluster network "
                   "(also $RLFLEET_BIND_HOST).")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, envvar="RLFLEET_METRICS_HOST",
              help="(also $RLFLEET_METRICS_HOST)")
@click.option("--metrics-port", default=0, show_default=True, envvar="RLFLEET_METRICS_PORT",
              help="0 picks a free port (also $RLFLEET_METRICS_PORT).")
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--backend", type=click.Choice(["process", "systemd"]), default=None,
              help="agent only: run placed daemons as subprocesses (default) or as systemd units "
                   "(then --metrics-port defaults to 9464).")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="agent only: a label of this host in nodes/<host> (repeatable; also $RLFLEET_LABELS "
                   "as 'roles=trainer,rollout;cpu=x86').")
def daemon(role: str, job: str, etcd: str, member_id: str | None, host: str, spec_file: str | None,
           bind_host: str | None, metrics_host: str, metrics_port: int, log_level: str, backend: str | None,
           labels: tuple[str, ...]) -> None:
    """Run one daemon of ROLE until SIGTERM (`agent`: this host's node agent, docs/operations/agent.md)."""
    from rlfleet.common.daemon import INCARNATION_ENV, DaemonOptions
    from rlfleet.common.logs import setup_json_logging
    from rlfleet.common.wire.sockets import flush_before_exit
    from rlfleet.daemons import daemon_class

    if failpoints.daemon_exits_at_start(role):
        click.echo(f"{failpoints.DAEMON}: {role} exits at start (test failpoint)", err=True)
        sys.exit(Exit.FAILURE)
    if spec_file:
        try:
            load_spec(spec_file)
        except SpecError as exc:
            click.echo(str(exc), err=True)
            sys.exit(EXIT_SPEC)
    node_args = _node_daemon_args(role, backend, labels, etcd)
    metrics_port = node_args.pop("metrics_port", metrics_port)
    member_id = member_id or (host if role in NODE_DAEMON_CLASSES else f"{host}-{role}-{os.getpid()}")
    setup_json_logging(log_level, job=job, role=role, id=member_id)
    options = DaemonOptions(job=job, member_id=member_id, host=host, spec_file=spec_file,
                            bind_host=bind_host or None, metrics_host=metrics_host, metrics_port=metrics_port,
                            incarnation=os.environ.get(INCARNATION_ENV, ""))
    instance = daemon_class(role)(options, _store(etcd), **node_args)
    if path := failpoints.daemon_stall_file(role):
        instance.cycle = _stall_if_file(instance.cycle, path)
    instance.install_signal_handlers()
    code = instance.run()
    if not flush_before_exit():
        logging.getLogger("rlfleet.daemon").warning(
            "exiting with ZeroMQ sockets still open: what they held queued may not have left")
    sys.exit(code)


def _node_daemon_args(role: str, backend: str | None, labels: tuple[str, ...], etcd: str) -> dict:
    """The agent's own arguments (and its --metrics-port default under systemd); {} for a job role."""
    if role not in NODE_DAEMON_CLASSES:
        if backend or labels:
            raise click.UsageError("--backend and --label are options of `rlfleet daemon agent` only")
        return {}
    from click.core import ParameterSource

    from rlfleet.daemons.agent.daemon import SYSTEMD_METRICS_PORT
    from rlfleet.daemons.agent.policy import parse_labels
    try:
        parsed = {**parse_labels(os.environ.get("RLFLEET_LABELS", "")), **parse_labels(";".join(labels))}
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--label / $RLFLEET_LABELS") from None
    args = {"backend": backend or "process", "labels": parsed, "etcd": etcd, "etcd_env": _etcd_credentials().env()}
    if backend == "systemd" and click.get_current_context().get_parameter_source("metrics_port") \
            == ParameterSource.DEFAULT:
        args["metrics_port"] = SYSTEMD_METRICS_PORT
    return args


def _stall_if_file(cycle, path: str):
    def stalling_cycle():
        try:
            os.unlink(path)  # only one process stalls per file
        except FileNotFoundError:
            return cycle()
        click.echo(f"{failpoints.DAEMON}: the main loop stalls now (test failpoint)", err=True)
        import threading
        threading.Event().wait()
    return stalling_cycle


# -- the embedded fleet ---------------------------------------------------------------
def _give_up(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, float]:
    deaths, sep, window = value.partition("/")
    try:
        n, window_s = int(deaths), float(window)
        if sep and n >= 0 and window_s > 0:
            return n, window_s
    except ValueError:
        pass
    raise click.BadParameter(f"expected DEATHS/SECONDS such as 5/60 (0/60: never give up), got {value!r}")


RUN_EPILOG = "\b\nExit codes:\n" + "\n".join(f"  {int(code)}  {text}" for code, text in RUN_CODES.items())


@main.command(epilog=RUN_EPILOG)
@click.argument("spec_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--etcd", default=None, metavar="HOST:PORT[,...]",
              help="Use this etcd instead of starting a private one.")
@etcd_credential_options
@click.option("--insecure", is_flag=True,
              help="No security (for debugging): plain-http etcd, ZeroMQ in the clear, relay unauthenticated. "
                   "Default: a private CA and client certificates for the private etcd, CURVE keys and a "
                   "relay job secret, all made for this run.")
@click.option("--duration", type=float, default=None,
              help="Stop by itself after this many seconds (exit 7 unless the trainer finished first).")
@click.option("--no-view", is_flag=True,
              help="Plain event lines instead of the live table (the default when stdout is not a terminal).")
@click.option("--give-up-after", "give_up", default="5/60", show_default=True, metavar="DEATHS/SECONDS",
              callback=_give_up, help="End the run (exit 5) when one daemon dies this often within the window; "
                                      "0/60 only reports it and keeps restarting.")
@click.option("--max-idle-s", type=click.FloatRange(min=0), default=300.0, show_default=True,
              help="End the run (exit 6) when no training step comes for this long, start-up included; 0: never.")
@click.option("--take-over", is_flag=True,
              help="Replace a live run of the same job on the same etcd (it stops its daemons and exits 8) "
                   "instead of refusing to start (exit 8).")
def run(spec_file: str, etcd: str | None, insecure: bool, duration: float | None, no_view: bool,
        give_up: tuple[int, float], max_idle_s: float, take_over: bool) -> None:
    """Run a whole job on this machine: etcd (private unless --etcd), every daemon, and a
    view of it: a live table in a terminal, plain event lines (progress every few seconds,
    restarts, evaluations) when output goes to a file or a pipe. Ends with a summary and
    one line saying how the run ended."""
    from rlfleet.tools.run.supervisor import Supervisor
    try:
        spec = load_spec(spec_file)
    except SpecError as exc:
        click.echo(str(exc), err=True)
        sys.exit(EXIT_SPEC)
    if insecure and (spec.security.curve or spec.security.relay_auth):
        click.echo(f"{spec_file}: [security] requires CURVE or relay authentication; --insecure cannot run it",
                   err=True)
        sys.exit(EXIT_SPEC)
    view = not no_view and sys.stdout.isatty()
    supervisor = Supervisor(spec, spec_file, etcd, Path(spec.job.runs_dir) / spec.job.name, view=view,
                            give_up=give_up, max_idle_s=max_idle_s, take_over=take_over,
                            secure=not insecure, etcd_creds=_etcd_credentials())
    sys.exit(supervisor.run(duration))


# -- operator views ----------------------------------------------------------------------
@main.command()
@click.option("--job", callback=job_name, default=None, help="Job name; optional when etcd holds only one.")
@etcd_option
@click.option("--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
def status(job: str | None, etcd: str, output: str) -> None:
    """Members, leaders, nodes and problems of a job (per role).

    A member is checked, not taken at its word: a pid on this machine must run and not
    be stopped, and its lease must have been refreshed within half its TTL; a dead,
    stopped or stalled member is a problem (exit 1), and so is a placed daemon its
    host's agent reports failing (it keeps dying), or an agent whose process is gone.

    To a terminal: tables at its width, long cells folded. To a file or a pipe: tables
    as wide as their contents, so ids, addresses and problems are never cut."""
    from rlfleet.common.control.keys import JobKeys
    from rlfleet.common.control.store import StoreUnavailable
    from rlfleet.tools.ctl.fleet_view import (
        etcdctl_equivalent,
        members_table,
        nodes_table,
        paused_banner,
        report_console,
        take_snapshot,
    )

    store = _store(etcd)
    try:
        job = _pick_job(store, job)
        snap = take_snapshot(store, job, check_leases=True)
    except StoreUnavailable as exc:
        _fail_unreachable(exc, etcd)
    from rlfleet.relay.status import chain_status, chain_table, versions_table
    try:
        relay = chain_status(store, job)
    except StoreUnavailable as exc:
        _fail_unreachable(exc, etcd)
    problems = snap.problems + list(relay.get("problems", []))
    if output == "json":
        click.echo(json.dumps({**snap.to_json(), "relay": relay, "problems": problems}, indent=2, default=str))
        sys.exit(1 if problems else 0)
    console = report_console()
    if banner := paused_banner(snap.cluster.state if snap.cluster is not None else None):
        console.print(banner)
    console.print(members_table(snap))
    console.print(nodes_table(snap))
    console.print(chain_table(relay))
    console.print(versions_table(relay))
    if relay.get("in_transit"):
        console.print(f"in transit: {', '.join(relay['in_transit'])} receiving version "
                      f"{(relay.get('latest') or {}).get('version')}")
    for problem in problems:
        console.print(f"[yellow]problem:[/yellow] {problem}")
    console.print(f"[dim]same data: {etcdctl_equivalent(etcd, JobKeys(job).prefix, credentials=_etcd_credentials().etcdctl_flags())}[/dim]")
    if problems:
        sys.exit(1)


@main.command()
@click.argument("prefix", default=ROOT_PREFIX)
@etcd_option
@click.option("--keys-only", is_flag=True)
def keys(prefix: str, etcd: str, keys_only: bool) -> None:
    """The raw key tree under PREFIX, values as JSON."""
    from rlfleet.common.control.store import StoreUnavailable
    from rlfleet.tools.ctl.fleet_view import etcdctl_equivalent

    try:
        items = _store(etcd).get_prefix(prefix)
    except StoreUnavailable as exc:
        _fail_unreachable(exc, etcd)
    for kv in items:
        click.echo(kv.key if keys_only else f"{kv.key}\t{json.dumps(kv.value, sort_keys=True)}")
    click.echo(f"# same data: {etcdctl_equivalent(etcd, prefix, keys_only, _etcd_credentials().etcdctl_flags())}", err=True)


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--job", callback=job_name, required=True)
@etcd_option
@click.option("--group-size", type=int, default=None, help="Default: the spec's task.group_size from etcd.")
def accounting(run_dir: str, job: str, etcd: str, group_size: int | None) -> None:
    """Check that every claimed prompt is trained, dropped with a reason, or in flight."""
    from rlfleet.common.control.cluster import read_spec
    from rlfleet.common.control.keys import JobKeys
    from rlfleet.common.control.store import StoreUnavailable
    from rlfleet.tools.ctl.accounting import check

    store = _store(etcd)
    try:
        if group_size is None:
            try:
                stored = read_spec(store, JobKeys(job))
            except SpecError as exc:
                raise click.UsageError(f"the spec of job {job!r} in etcd does not validate ({exc}); "
                                       "pass --group-size") from None
            if stored is None:
                raise click.UsageError(f"no spec for job {job!r} in etcd; pass --group-size")
            group_size = stored.task.group_size + stored.env_host.redundant_samples  # launched per prompt
        result = check(store, job, Path(run_dir), group_size)
    except StoreUnavailable as exc:
        _fail_unreachable(exc, etcd)
    click.echo(json.dumps(result.to_json(), indent=2))
    click.echo(result.sentence(), err=True)
    sys.exit(0 if result.ok else 1)


# -- job specs ----------------------------------------------------------------------------
@main.group()
def job() -> None:
    """Validate and submit job specs."""


@job.command()
@click.argument("spec_files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--no-import-check", is_flag=True,
              help="Skip checking that each kind's library (vllm for the vllm engine) imports in this "
                   "Python: for a spec whose daemons run on other machines or in another venv.")
def validate(spec_files: tuple[str, ...], no_import_check: bool) -> None:
    """Check spec files; print every error with its key path.

    Also checks that this Python can run each kind the spec names (e.g. `import vllm`
    for [rollout.engine] kind = "vllm"), unless --no-import-check."""
    bad = 0
    for path in spec_files:
        try:
            spec = load_spec(path, check_imports=not no_import_check)
            click.echo(f"{path}: ok (job {spec.job.name}, task {spec.task.env.kind}, "
                       f"engine {spec.rollout.engine.kind}, loss {spec.trainer.loss.kind}, "
                       f"{sum(spec.all_roles().values())} daemons)")
        except SpecError as exc:
            bad += 1
            click.echo(str(exc), err=True)
    if bad:
        sys.exit(EXIT_SPEC)


@job.command()
@click.argument("spec_file", type=click.Path(exists=True, dir_okay=False))
@etcd_option
@click.option("--force", is_flag=True,
              help="Replace the spec of a job whose daemons are registered (they reload it on SIGHUP).")
def submit(spec_file: str, etcd: str, force: bool) -> None:
    """Write a validated spec to /rlfleet/<job>/spec (daemons pick it up).

    A job with live daemons keeps its spec unless --force; a job an `rlfleet run` owns
    is never changed from outside (the run started its daemons from its own file)."""
    from rlfleet.common.control.keys import JobKeys
    from rlfleet.common.control.members import Owner
    from rlfleet.common.control.store import StoreUnavailable
    try:
        spec = load_spec(spec_file)
    except SpecError as exc:
        click.echo(str(exc), err=True)
        sys.exit(EXIT_SPEC)
    keys = JobKeys(spec.job.name)
    try:
        store = _store(etcd)
        held = store.get(keys.spec)
        owner = store.get(keys.owner)
        live = sorted("/".join(keys.parse_member(kv.key)) for kv in store.get_prefix(keys.members_prefix)
                      if kv.key.count("/") == keys.members_prefix.count("/") + 1) if held else []
        if owner is not None:
            o = Owner.from_kv(owner)
            click.echo(f"refused: job {spec.job.name!r} is run by `rlfleet run` on {o.host or '?'} (pid {o.pid}, "
                       f"incarnation {o.incarnation}); change the file it runs and restart it, or stop it first",
                       err=True)
            sys.exit(Exit.REFUSED)
        if held is not None and held.value == spec.to_dict():
            click.echo(f"{keys.spec} already holds this spec: nothing to do")
            return
        if held is not None and live and not force:
            click.echo(f"refused: job {spec.job.name!r} is live ({', '.join(live)} registered) and has a spec; "
                       f"--force replaces it (a changed spec reaches each daemon at its next SIGHUP or restart)",
                       err=True)
            sys.exit(Exit.REFUSED)
        store.put(keys.spec, spec.to_dict())
    except StoreUnavailable as exc:
        _fail_unreachable(exc, etcd)
    click.echo(f"submitted {spec_file} to {keys.spec}" + (" (replacing a live job's spec)" if live else ""))


# -- operating a live job (docs/operations/live-fleet.md): each group is its own module ----------------
from rlfleet.tools.ctl.curve import curve_authorize, curve_keys, curve_probe  # noqa: E402  (docs/operations/security.md)
from rlfleet.tools.ctl.etcd import etcd_group  # noqa: E402  (docs/operations/etcd-maintenance.md)
from rlfleet.tools.ctl.node import node  # noqa: E402
from rlfleet.tools.ctl.pause import pause, resume  # noqa: E402  (docs/operations/maintenance-mode.md)
from rlfleet.tools.ctl.reward_service import reward_service  # noqa: E402  (docs/design/reward.md)
from rlfleet.tools.ctl.stop import start, stop  # noqa: E402  (docs/operations/maintenance-mode.md)
from rlfleet.tools.ctl.switchover import switchover  # noqa: E402  (docs/operations/switchover.md)

main.add_command(curve_keys)
main.add_command(curve_authorize)
main.add_command(curve_probe)
main.add_command(node)
main.add_command(switchover)
main.add_command(pause)
main.add_command(resume)
main.add_command(stop)
main.add_command(start)
main.add_command(etcd_group)
main.add_command(reward_service)

if __name__ == "__main__":
    main()
