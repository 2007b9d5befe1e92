"""`rlfleet curve-keys`, `rlfleet curve-authorize` and `rlfleet curve-probe`: a machine's CURVE
key files (docs/operations/security.md, "Roles"), made and shared in one command per host each, as
Ansible runs them (ansible/roles/rlfleet/tasks/curve.yml): a file per (host, role) per host was
a task each, N x 7 of them on every one of N hosts; and a check, from a host, of what the
running daemons' ZAP handlers decide about its keys.

    rlfleet curve-keys DIR --role trainer --role env-host ... --json   # make what is missing
    rlfleet curve-keys DIR --show --json                               # only read
    echo '{"h1": {"trainer": "<z85>", ...}, ...}' | rlfleet curve-authorize DIR
    rlfleet curve-probe DIR 'tcp://10.0.0.5:41231?curve=<z85>' ... --json

``--json`` prints ``{"created": [roles], "public": {role: z85}}`` (every pair in DIR);
curve-authorize reads ``{host: {role: z85}}`` and writes ``authorized/<role>/<host>.key``
where it differs, printing ``{"changed": [paths]}``; curve-probe prints
``{address: {role: result}}``.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

import click
import zmq
from zmq.utils.monitor import recv_monitor_message

from rlfleet.common.spec.placement import ROLES
from rlfleet.common.wire import curve

_Z85_KEY = re.compile(r"^[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a host name as a file name


# What a client's own handshake events say the server decided (libzmq reports the ZAP
# handler's 400 as FAILED_AUTH); a probe that sees none of them by its deadline: "no answer".
PROBE_RESULTS = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "admitted",
                 zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused (auth)",
                 zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "refused (protocol)",
                 zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "refused (no detail)"}
NO_ANSWER = "no answer"


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
                   f"authorized/{role + '/' if role else ''} (their daemons admit it at its next handshake)")
    if not created:
        click.echo(json.dumps(public, indent=2))


@click.command("curve-authorize")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
def curve_authorize(directory: Path) -> None:
    """Authorize the public keys read as JSON on stdin, {host: {role: key}}, under their
    roles in DIRECTORY/authorized/ (only files that differ are written); prints
    {"changed": [paths]}. A running daemon admits a new key at its next handshake (it re-reads
    the folder for a key it does not know); a removed key only after its next SIGHUP."""
    try:
        keys = json.loads(sys.stdin.read())
        changed = authorize(directory, keys)
    except (ValueError, OSError) as exc:
        raise click.ClickException(f"curve-authorize: {exc}") from None
    click.echo(json.dumps({"changed": changed}))


def probe(keys: dict[str, tuple[bytes, bytes]], addresses: list[str],
          timeout_s: float) -> dict[str, dict[str, str]]:
    """{address: {role: result}}: each published address (with its ``?curve=`` server key)
    tried with each role's (public, secret) pair, all at once, each until its first
    handshake event or ``timeout_s``. No message is sent. ValueError for an address
    without a server key."""
    servers = {address: curve.split(address) for address in addresses}
    keyless = [address for address, (_, key) in servers.items() if key is None]
    if keyless:
        raise ValueError(f"no CURVE server key in {', '.join(keyless)} (expected tcp://HOST:PORT?curve=<40 characters>)")
    ctx = zmq.Context()
    clients = []  # held: pyzmq closes a socket nothing refers to
    waiting: dict[zmq.Socket, tuple[str, str]] = {}  # monitor -> (address, role)
    found = {address: dict.fromkeys(keys, NO_ANSWER) for address in addresses}
    try:
        for address, (plain, server_key) in servers.items():
            for role, (public, secret) in keys.items():
                sock = ctx.socket(zmq.DEALER)
                sock.linger = 0
                sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_key
                waiting[sock.get_monitor_socket(sum(PROBE_RESULTS))] = (address, role)
                clients.append(sock)
                sock.connect(plain)
        poller = zmq.Poller()
        for monitor in waiting:
            poller.register(monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while waiting and (left := deadline - time.monotonic()) > 0:
            for monitor, _ in poller.poll(left * 1000):
                address, role = waiting.pop(monitor)
                found[address][role] = PROBE_RESULTS[recv_monitor_message(monitor)["event"]]
                poller.unregister(monitor)
    finally:
        ctx.destroy(linger=0)  # every client and monitor socket
    return found


@click.command("curve-probe")
@click.argument("directory", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.argument("addresses", nargs=-1, required=True, metavar="ADDRESS...")
@click.option("--role", "roles", type=click.Choice(ROLES), multiple=True,
              help="A role whose pair to connect with (repeatable; default: every ROLE.key_secret in DIRECTORY). "
                   "A role without a pair there uses daemon.key_secret, as its daemon would.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True,
              help="Seconds to wait for every handshake (all are tried at once).")
@click.option("--json", "as_json", is_flag=True, help="Print {address: {role: result}}.")
def curve_probe(directory: Path, addresses: tuple[str, ...], roles: tuple[str, ...], timeout_s: float,
                as_json: bool) -> None:
    """Connect to each published ADDRESS (tcp://HOST:PORT?curve=KEY, as a daemon registers it)
    with each role's key pair from DIRECTORY and print what the server's ZAP handler decided:
    admitted, refused (auth) (a key it does not hold, or of a role its socket does not admit),
    refused (protocol), refused (no detail), or no answer. Sends no message. Exits 0 whatever
    the results: it reports, it does not judge (docs/operations/security.md)."""
    for address in addresses:
        if curve.split(address)[1] is None:
            raise click.BadParameter(f"{address!r} carries no CURVE server key (?curve=<40 characters>)",
                                     param_hint="ADDRESS")
    try:
        chosen = roles or tuple(pairs(directory))
        if not chosen:
            raise click.UsageError(f"{directory} holds no ROLE.key_secret; name a --role (its daemon.key_secret is used)")
        keys = {role: curve.read_pair(curve.pair_file(directory, role)) for role in chosen}
        found = probe(keys, list(addresses), timeout_s)
    except (ValueError, OSError) as exc:  # CurveError, SecretFileError: a key file unusable
        raise click.ClickException(f"curve-probe: {exc}") from None
    if as_json:
        click.echo(json.dumps(found))
        return
    rows = [("ADDRESS", "ROLE", "RESULT")] + [(a, r, result) for a, by_role in found.items()
                                               for r, result in by_role.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    for address, role, result in rows:
        click.echo(f"{address.ljust(widths[0])}  {role.ljust(widths[1])}  {result}")
