"""`rlfleet curve-keys` and `rlfleet curve-authorize`: a machine's CURVE key files
(docs/operations/security.md, "Roles"), made and shared in one command per host each, as Ansible
runs them (ansible/roles/rlfleet/tasks/curve.yml): a file per (host, role) per host was
a task each, N x 7 of them on every one of N hosts.

    rlfleet curve-keys DIR --role trainer --role env-host ... --json   # make what is missing
    rlfleet curve-keys DIR --show --json                               # only read
    echo '{"h1": {"trainer": "<z85>", ...}, ...}' | rlfleet curve-authorize DIR

``--json`` prints ``{"created": [roles], "public": {role: z85}}`` (every pair in DIR);
curve-authorize reads ``{host: {role: z85}}`` and writes ``authorized/<role>/<host>.key``
where it differs, printing ``{"changed": [paths]}``.
"""

from __future__ import annotations

import json
import re
import socket
import sys
from pathlib import Path
from typing import Any

import click

from rlfleet.common.spec.placement import ROLES
from rlfleet.common.wire import curve

_Z85_KEY = re.compile(r"^[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a host name as a file name


def pairs(directory: Path) -> dict[str, str]:
    """{role: public key} of every role's pair in ``directory``."""
    return {role: curve.read_pair(directory / curve.secret_file(role))[0].decode()
            for role in ROLES if (directory / curve.secret_file(role)).exists()}


def authorize(directory: Path, keys: Any) -> list[str]:
    """Write ``{host: {role: z85}}`` as ``authorized/<role>/<host>.key``, only what
    differs; the paths written. ValueError naming the first bad entry."""
    if not isinstance(keys, dict):
        raise ValueError(f"expected an object {{host: {{role: key}}}}, got {type(keys).__name__}")
    files: dict[Path, bytes] = {}
    for host, by_role in keys.items():
        if not isinstance(host, str) or not _NAME.match(host) or not isinstance(by_role, dict):
            raise ValueError(f"host {host!r}: expected a host name and an object {{role: key}}")
        for role, key in by_role.items():
            if role not in ROLES:
                raise ValueError(f"{host}: {role!r} is not a role ({', '.join(ROLES)})")
            if not isinstance(key, str) or not _Z85_KEY.match(key):
                raise ValueError(f"{host}/{role}: not a 40-character Z85 public key: {key!r}")
            files[directory / curve.AUTHORIZED_DIR / role / f"{host}.key"] = curve.public_cert(key.encode())
    changed = []
    for path, content in files.items():
        if path.exists() and path.read_bytes() == content:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.parent.chmod(0o755)
        path.write_bytes(content)
        path.chmod(0o644)
        changed.append(str(path))
    return changed


@click.command("curve-keys")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--name", default=socket.gethostname(), show_default=True,
              help="Name of the public key files (authorized/ROLE/NAME.key) the other machines get.")
@click.option("--role", "roles", type=click.Choice(ROLES), multiple=True,
              help="A role to make a pair for (repeatable; an existing pair is kept). Its daemons use it; "
                   "common/wire/edges.py says where it may send.")
@click.option("--show", is_flag=True, help="Make nothing; print the pairs there are (with --json).")
@click.option("--json", "as_json", is_flag=True, help='Print {"created": [...], "public": {role: key}}.')
def curve_keys(directory: Path, name: str, roles: tuple[str, ...], show: bool, as_json: bool) -> None:
    """Make this machine's CURVE key pairs in DIRECTORY (docs/operations/security.md): DIRECTORY/ROLE.key_secret
    (mode 0600) per --role, each public key authorized in DIRECTORY/authorized/ROLE/NAME.key.
    Without --role (and --show): DIRECTORY/daemon.key_secret and authorized/NAME.key, a
    key no daemon socket admits (for a socket that names no edge)."""
    created = []
    try:
        if not show:
            if not roles and (directory / curve.SECRET_FILE).exists():
                raise click.UsageError(f"{directory / curve.SECRET_FILE} exists; move it away to make a new pair")
            for role in roles or ("",):
                if role and (directory / curve.secret_file(role)).exists():
                    continue
                curve.create_keys(directory, name, role)
                created.append(role)
        public = pairs(directory)
    except (curve.CurveError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps({"created": created, "public": public}))
        return
    for role in created:
        key_file = directory / curve.AUTHORIZED_DIR / role / f"{name}.key"
        click.echo(f"public key of {role or 'no role'}: copy {key_file} into every other machine's "
                   f"authorized/{role + '/' if role else ''} (then SIGHUP their daemons)")
    if not created:
        click.echo(json.dumps(public, indent=2))


@click.command("curve-authorize")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
def curve_authorize(directory: Path) -> None:
    """Authorize the public keys read as JSON on stdin, {host: {role: key}}, under their
    roles in DIRECTORY/authorized/ (only files that differ are written); prints
    {"changed": [paths]}. Running daemons read them at their next SIGHUP."""
    try:
        keys = json.loads(sys.stdin.read())
        changed = authorize(directory, keys)
    except (ValueError, OSError) as exc:
        raise click.ClickException(f"curve-authorize: {exc}") from None
    click.echo(json.dumps({"changed": changed}))
