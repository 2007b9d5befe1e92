"""`python -m rlfleet.tools.lab`: build the base, boot and tear down labs of systemd hosts.

Every command but `build` and `wheelhouse` takes `--name` (default "lab"); the lab's
files are in /var/lib/rlfleet-lab/<name>/ (state.json, ssh_config, inventory.ini).
Exit codes: 0 ok, 1 a lab step failed (the message says which host and why),
2 bad usage; `exec`, `ssh` and `ansible` exit with their command's code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click

from rlfleet.tools.lab.paths import lab_dir

REPO = Path(__file__).resolve().parents[2]
name_option = click.option("--name", default="lab", show_default=True,
                           help="Lab name; also the name of its network namespace.")


def _lab(name: str):
    from rlfleet.tools.lab.hosts import Lab
    try:
        return Lab(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--name") from None


def _root() -> None:
    from rlfleet.tools.lab.commands import require_root
    require_root()


def _fail(exc: Exception) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(1)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """A lab of real systemd hosts (systemd-nspawn) on this machine, for the cluster path (docs/operations/lab.md)."""


@main.command()
@click.option("--mirror", default=None, help="Debian mirror (default: the one in /etc/apt).")
@click.option("--force", is_flag=True, help="Rebuild the base even when the cache is current.")
def build(mirror: str | None, force: bool) -> None:
    """Install the controller's packages and build (or reuse) the cached base rootfs."""
    _root()
    from rlfleet.tools.lab import rootfs
    from rlfleet.tools.lab.commands import CommandFailed
    try:
        rootfs.build(mirror, force)
    except CommandFailed as exc:
        _fail(exc)


@main.command()
@click.option("--repo", type=click.Path(exists=True, file_okay=False, path_type=Path), default=REPO,
              show_default=True, help="Working tree whose rlfleet wheel is built.")
@click.option("--force", is_flag=True, help="Rebuild every wheel, not only rlfleet's.")
def wheelhouse(repo: Path, force: bool) -> None:
    """Build the wheelhouse the hosts install rlfleet[ml] from (mounted at /srv/wheelhouse)."""
    from rlfleet.tools.lab import wheelhouse as wh
    from rlfleet.tools.lab.commands import CommandFailed
    try:
        wh.build(repo, force=force)
    except CommandFailed as exc:
        _fail(exc)


@main.command()
@name_option
@click.option("--hosts", "count", type=click.IntRange(1, 99), default=3, show_default=True)
@click.option("--subnet", default="10.210.0", show_default=True, help="First three octets; hosts get .1..N, the controller .254.")
@click.option("--timeout", default=180.0, show_default=True, help="Seconds for every host to boot and answer SSH.")
def up(name: str, count: int, subnet: str, timeout: float) -> None:
    """Boot hosts h1..hN, each in its own network namespace on the lab's bridge."""
    _root()
    import time

    from rlfleet.tools.lab.commands import CommandFailed
    from rlfleet.tools.lab.hosts import LabError
    lab = _lab(name)
    t0 = time.monotonic()
    try:
        ready = lab.up(count, subnet, timeout)
    except (LabError, CommandFailed) as exc:
        _fail(f"{exc}\n(`down --name {name}` removes what was started)")
    d = lab.dir
    click.echo(f"lab {name} up: {count} hosts in {time.monotonic() - t0:.1f} s "
               f"({sum(r.system == 'degraded' for r in ready)} degraded)")
    click.echo(f"  state      {d / 'state.json'}\n  inventory  {d / 'inventory.ini'}\n"
               f"  ssh        ip netns exec {name} ssh -F {d / 'ssh_config'} h1")


@main.command()
@name_option
@click.option("--timeout", default=30.0, show_default=True, help="Seconds for a clean power-off before SIGKILL.")
def down(name: str, timeout: float) -> None:
    """Power every host off and remove the lab (namespaces, mounts, disks). Idempotent."""
    _root()
    left = _lab(name).down(timeout)
    if any(left.values()):
        sys.exit(1)


@main.command("add-host")
@name_option
@click.option("--timeout", default=120.0, show_default=True, help="Seconds for the new host to boot and answer SSH.")
def add_host(name: str, timeout: float) -> None:
    """Boot one more host, h<N+1>, in a running lab (a machine added to a live job); the
    inventory, ssh_config and every host's /etc/hosts name it from then on."""
    _root()
    from rlfleet.tools.lab.commands import CommandFailed
    from rlfleet.tools.lab.hosts import LabError
    try:
        ready = _lab(name).add_host(timeout)
    except (LabError, CommandFailed) as exc:
        _fail(exc)
    click.echo(f"{ready.host} up in {ready.seconds:.1f} s ({ready.system})")


@main.command()
@name_option
@click.argument("host")
def poweroff(name: str, host: str) -> None:
    """Pull HOST's plug (SIGKILL its systemd); its disk stays for `start`."""
    _root()
    from rlfleet.tools.lab.hosts import LabError
    try:
        _lab(name).poweroff(host)
    except LabError as exc:
        _fail(exc)
    click.echo(f"{host} powered off")


@main.command()
@name_option
@click.argument("host")
@click.option("--timeout", default=120.0, show_default=True)
def start(name: str, host: str, timeout: float) -> None:
    """Boot a powered-off HOST again, with the disk it had."""
    _root()
    from rlfleet.tools.lab.hosts import LabError
    try:
        _lab(name).start(host, timeout)
    except LabError as exc:
        _fail(exc)


@main.command(name="exec", context_settings={"ignore_unknown_options": True})
@name_option
@click.argument("host")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_(name: str, host: str, cmd: tuple[str, ...]) -> None:
    """Run CMD inside HOST (nsenter into its namespaces): exec --name lab h2 -- systemctl status."""
    _become(lambda lab: lab.exec_argv(host, list(cmd)), name)


def _become(argv_of, name: str) -> None:
    """Replace this process with the command argv_of(lab) builds (a LabError: said, exit 1)."""
    _root()
    from rlfleet.tools.lab.hosts import LabError
    try:
        argv = argv_of(_lab(name))
    except LabError as exc:
        _fail(exc)
    os.execvp(argv[0], argv)


@main.command(context_settings={"ignore_unknown_options": True})
@name_option
@click.argument("host")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
def ssh(name: str, host: str, cmd: tuple[str, ...]) -> None:
    """SSH to HOST from the lab's namespace (as root, with the lab's key): ssh --name lab h1 -- uptime."""
    _become(lambda lab: lab.ssh_argv(host, list(cmd)), name)


@main.command(context_settings={"ignore_unknown_options": True})
@name_option
@click.argument("args", nargs=-1, required=True, type=click.UNPROCESSED)
def ansible(name: str, args: tuple[str, ...]) -> None:
    """Run an Ansible program in the lab's namespace with its inventory and key:
    ansible --name lab -- ansible-playbook -i groups.ini site.yml."""
    _root()
    from rlfleet.tools.lab.hosts import LabError
    try:
        argv, env = _lab(name).ansible_argv(list(args))
    except LabError as exc:
        _fail(exc)
    sys.exit(subprocess.run(argv, env=env).returncode)


@main.command()
@name_option
@click.option("--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
def status(name: str, output: str) -> None:
    """Each host: power, systemd state, memory (PSS of its processes), disk (its overlay)."""
    _root()
    from rlfleet.tools.lab.hosts import LabError
    try:
        rows = _lab(name).status()
    except LabError as exc:
        _fail(exc)
    if output == "json":
        click.echo(json.dumps({"lab": name, "dir": str(lab_dir(name)), "hosts": rows}, indent=1))
        return
    click.echo(f"{'host':5} {'ip':14} {'power':5} {'system':10} {'procs':>5} {'PSS MiB':>8} {'disk MiB':>8}")
    for r in rows:
        pss = "-" if r["pss_mib"] is None else f"{r['pss_mib']:.1f}"
        disk = "-" if r["disk_mib"] is None else f"{r['disk_mib']:.1f}"
        click.echo(f"{r['host']:5} {r['ip']:14} {r['power']:5} {r['system']:10} {r['processes']:>5} {pss:>8} {disk:>8}")
    on = [r["pss_mib"] for r in rows if r["pss_mib"] is not None]
    if on:
        click.echo(f"memory per running host (PSS): mean {sum(on) / len(on):.1f} MiB, max {max(on):.1f} MiB")
