"""CURVE on every ZeroMQ socket of a process, configured once (docs/operations/security.md).

A daemon calls ``configure_from_env()`` at start (``RLFLEET_CURVE_DIR``); from then on
every socket ``common/wire/sockets.py`` makes carries the process's key pair, with no
change at any call site:

- a server (ROUTER) is a CURVE server, and a ZAP handler on its context admits only
  clients whose public key is in ``<dir>/authorized/*.key``: CURVE alone admits anyone
  who knows the server's public key (which etcd shows to every reader);
- the endpoint a server publishes (``addresses`` in its member registration) carries
  its public key: ``tcp://10.0.0.5:41231?curve=<40 Z85 characters>``. A client
  (DEALER) takes the key from the address it was given, so it authenticates the
  server it reaches: no one without the server's secret can answer in its name.

Refusals are logged once per peer and kind and counted in
``rlfleet_auth_refused_total``: a client with a key not on the list (ZAP, with its
IP and key), and a client that does not speak CURVE or has the wrong server key
(a socket monitor on each server socket; libzmq drops those before ZAP is asked).

Roles (common/wire/edges.py): each server socket names its edge, and its ZAP handler admits
only keys of the roles that edge lists; a key's role is the folder it is authorized in.

The authorized set is read at start and again on SIGHUP (``reload_authorized``); a key the
set does not hold also has the ZAP thread re-read it when ``authorized/`` changed since the
last read (its files' names, sizes and mtimes), so a host authorized after the daemon
started is admitted at its first handshake, and a client sending unknown keys costs a
listing of the folder, never a read. A removed key is still admitted until SIGHUP: a known
key never looks at the disk.

The directory::

    <dir>/<role>.key_secret         the key pair of this machine's daemons of <role> (0600)
    <dir>/daemon.key_secret         the pair of a daemon whose role has none (one pair for all)
    <dir>/authorized/<role>/*.key   public keys that speak for <role>
    <dir>/authorized/*.key          keys without a role: admitted only by sockets naming no edge
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import queue
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
from prometheus_client import Counter
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from rlfleet.common.secret_files import read_private, write_private
from rlfleet.common.spec.placement import ROLES
from rlfleet.common.wire import edges

log = logging.getLogger("rlfleet.auth")

ENV_DIR = "RLFLEET_CURVE_DIR"
SECRET_FILE = "daemon.key_secret"
AUTHORIZED_DIR = "authorized"
KEY_MARK = "?curve="  # endpoint + KEY_MARK + the server's Z85 public key
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP RFC (27/ZAP)
_MAX_REMEMBERED = 10_000  # peers logged once each; past this many only counted (a flood)

REFUSED = Counter("rlfleet_auth_refused_total", "Connections refused for authentication",
                  ["transport", "reason"])

_CERT_KEY = re.compile(rb'^\s*(public|secret)-key\s*=\s*"(.{40})"\s*$', re.MULTILINE)


class CurveError(ValueError):
    """CURVE keys missing or unusable; the message names the file and the fix."""


@dataclass(frozen=True)
class CurveSetup:
    public: bytes            # Z85, 40 bytes
    secret: bytes
    roles: dict[bytes, str]  # Z85 public key of each client allowed in -> the role it speaks for ("": none)
    directory: str
    read_from: tuple[tuple[str, int, int], ...] | None = None  # authorized/ as it was read (authorized_listing)

    @property
    def authorized(self) -> frozenset[bytes]:
        return frozenset(self.roles)

    @classmethod
    def load(cls, directory: str | os.PathLike[str], role: str = "") -> CurveSetup:
        """The pair of ``role`` (``<role>.key_secret``) where there is one, else the
        directory's one pair (``daemon.key_secret``)."""
        public, secret = read_pair(pair_file(directory, role))
        folder = Path(directory) / AUTHORIZED_DIR
        listing = authorized_listing(folder)  # before the read: a change during it is seen next time
        return cls(public, secret, load_authorized(folder), str(Path(directory)), listing)


def read_pair(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a secret key file (it must be 0600 or 0400)."""
    keys = dict((k.decode(), v) for k, v in _CERT_KEY.findall(read_private(path, "CURVE secret key file")))
    if "public" not in keys or "secret" not in keys:
        raise CurveError(f"{path}: no public-key/secret-key pair "
                         "(create one with `rlfleet curve-keys DIR --role ROLE`)")
    if zmq.curve_public(keys["secret"]) != keys["public"]:
        raise CurveError(f"{path}: the public key does not belong to the secret key")
    return keys["public"], keys["secret"]


def public_cert(public: bytes) -> bytes:
    """An authorized/*.key file's content for ``public``."""
    return _cert(public, None)


def secret_file(role: str) -> str:
    return f"{role}.key_secret" if role else SECRET_FILE


def pair_file(directory: str | os.PathLike[str], role: str = "") -> Path:
    """The secret key file a daemon of ``role`` uses: ``<role>.key_secret`` where there is
    one, else ``daemon.key_secret``."""
    own = Path(directory) / secret_file(role)
    return own if role and own.exists() else Path(directory) / SECRET_FILE


def authorized_listing(directory: Path) -> tuple[tuple[str, int, int], ...] | None:
    """``directory``, its folders and each ``*.key`` file in them as (relative path, mtime
    in ns, size): what tells a re-read would find something new. None: unreadable."""
    try:
        folders = [directory, *sorted(p for p in directory.iterdir() if p.is_dir())]
        found = []
        for folder in folders:
            for path in [folder, *sorted(folder.glob("*.key"))]:
                st = path.stat()
                found.append((str(path.relative_to(directory)), st.st_mtime_ns, st.st_size))
        return tuple(found)
    except OSError:
        return None


def load_authorized(directory: Path) -> dict[bytes, str]:
    """{public key: role} from ``*.key`` (no role) and ``<role>/*.key``. A key listed
    under two roles is refused: it could speak for either."""
    if not directory.is_dir():
        raise CurveError(f"{directory}: no such directory of authorized public keys (*.key)")
    found: dict[bytes, str] = {}
    folders = [("", directory)] + [(p.name, p) for p in sorted(directory.iterdir()) if p.is_dir()]
    for role, folder in folders:
        if role and role not in ROLES:
            raise CurveError(f"{folder}: not a role ({', '.join(ROLES)}); a key's folder names its role")
        for path in sorted(folder.glob("*.key")):
            for kind, value in _CERT_KEY.findall(path.read_bytes()):
                if kind != b"public":
                    continue
                if found.get(value, role) != role:
                    raise CurveError(f"{path}: key {value.decode()} is authorized for two roles "
                                     f"({found[value] or 'none'} and {role or 'none'})")
                found[value] = role
    if not found:
        raise CurveError(f"{directory}: no public key in any *.key file; no client could connect")
    return found


def _cert(public: bytes, secret: bytes | None) -> bytes:
    lines = ["#   rlfleet CURVE certificate (ZeroMQ/pyzmq format)", "metadata", "curve",
             f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return ("\n".join(lines) + "\n").encode()


def create_keys(directory: str | os.PathLike[str], name: str = "daemon", role: str = "") -> bytes:
    """A new key pair in ``directory`` (secret 0600: ``<role>.key_secret``, or
    ``daemon.key_secret`` without a role), its public key authorized there too, as
    ``authorized/<role>/<name>.key``; returns the public key. On a cluster, copy each
    host's public keys into every other host's ``authorized/<role>/``."""
    if role and role not in ROLES:
        raise CurveError(f"{role!r} is not a role ({', '.join(ROLES)})")
    d = Path(directory)
    folder = d / AUTHORIZED_DIR / role if role else d / AUTHORIZED_DIR
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    public, secret = zmq.curve_keypair()
    write_private(d / secret_file(role), _cert(public, secret))
    (folder / f"{name}.key").write_bytes(_cert(public, None))
    return public


# ----------------------------------------------------------------- the process's setup
_active: CurveSetup | None = None
_guards: dict[int, tuple[_ZapHandler, _HandshakeWatch]] = {}  # id(context) -> its threads
_lock = threading.Lock()
# Replacing _active: a re-read (SIGHUP, or a ZAP thread meeting an unknown key) and
# configure() take turns, so a late re-read never brings back a setup configure() ended.
# A ZAP thread takes only this lock: configure() joins ZAP threads while holding _lock.
_setup_lock = threading.Lock()
_failed_listing: tuple | None = None  # authorized/ as a failed re-read saw it: not tried again unchanged
_reread_failure = ""      # the last failed re-read's error, logged once until it changes


def configure(setup: CurveSetup | None) -> None:
    """Turn CURVE on for every socket made from now on (None: off, for tests)."""
    global _active, _failed_listing
    with _lock:
        with _setup_lock:
            _active = setup
            _failed_listing = None
        if setup is None:
            for zap, watch in _guards.values():
                zap.stop()
                watch.stop()
            _guards.clear()


def stop_guards(ctx: zmq.Context) -> None:
    """Stop the ZAP handler and handshake watch of ``ctx``: its process is ending it."""
    with _lock:
        pair = _guards.pop(id(ctx), None)
    for thread in pair or ():
        thread.stop()


def configure_from_env(directory: str | None = None, role: str = "") -> CurveSetup | None:
    """From ``$RLFLEET_CURVE_DIR`` (else ``directory``, the spec's security.curve_dir),
    with ``role``'s key pair; None when neither names a directory. CurveError /
    SecretFileError when it cannot be used."""
    where = os.environ.get(ENV_DIR) or directory
    if not where:
        return None
    setup = CurveSetup.load(where, role)
    configure(setup)
    return setup


def active() -> CurveSetup | None:
    return _active


def reload_authorized() -> str:
    """Re-read ``authorized/`` (SIGHUP): new clients are checked against it at once, and
    a removed key is refused from then on. CurveError when it cannot be read."""
    setup = _reread()
    return f"CURVE: {len(setup.roles)} authorized key(s)" if setup is not None else ""


def _reread() -> CurveSetup | None:
    """The process's setup with ``authorized/`` read again, made the active one (None:
    CURVE is off). CurveError or OSError when it cannot be read; the current set stays."""
    global _active
    with _setup_lock:
        setup = _active
        if setup is None:
            return None
        folder = Path(setup.directory) / AUTHORIZED_DIR
        listing = authorized_listing(folder)
        keys = load_authorized(folder)
        _active = CurveSetup(setup.public, setup.secret, keys, setup.directory, listing)
        return _active


def _reread_for_unknown_key() -> CurveSetup | None:
    """The setup re-read for a client key it does not hold, or None when ``authorized/``
    has not changed since it was last read (or since a re-read of it failed), or this
    re-read failed (logged once per distinct error)."""
    global _failed_listing, _reread_failure
    with _setup_lock:
        setup = _active
        if setup is None:
            return None
        listing = authorized_listing(Path(setup.directory) / AUTHORIZED_DIR)
        if listing is not None and listing in (setup.read_from, _failed_listing):
            return None  # nothing new on disk: the key is not authorized
    try:
        fresh = _reread()
    except (CurveError, OSError) as exc:  # a half-written folder: keep the set we have
        _failed_listing = listing
        if str(exc) != _reread_failure:
            _reread_failure = str(exc)
            log.warning("kept the authorized CURVE keys: re-reading them for an unknown key failed: %s", exc,
                        extra={"event": "auth_reload_failed"})
        return None
    _reread_failure = ""
    return fresh


# ----------------------------------------------------------------- sockets
def arm(sock: zmq.Socket, server: bool, edge: str = "") -> None:
    """Give a new socket the process's keys (nothing when CURVE is off); a server names
    its ``edge`` (common/wire/edges.py), which decides the roles it admits."""
    zap_domain = edges.domain(edge)  # an unknown edge is a ValueError, CURVE on or off
    setup = _active
    if setup is None:
        return
    sock.curve_publickey = setup.public
    sock.curve_secretkey = setup.secret
    if server:
        _guard(sock.context).watch(sock)  # ZAP bound before this socket can accept anyone
        sock.zap_domain = zap_domain
        sock.curve_server = True


def publish(endpoint: str, sock: zmq.Socket) -> str:
    """The endpoint a server publishes: with the process's public key when CURVE is on
    (libzmq cannot read a socket's key back; daemons never pass keys of their own)."""
    setup = _active
    if setup is not None and sock.getsockopt(zmq.MECHANISM) == zmq.CURVE and sock.getsockopt(zmq.CURVE_SERVER):
        return f"{endpoint}{KEY_MARK}{setup.public.decode()}"
    return endpoint


def split(address: str) -> tuple[str, bytes | None]:
    """'tcp://h:p?curve=KEY' -> ('tcp://h:p', b'KEY'); no key -> (address, None)."""
    plain, _, key = address.partition(KEY_MARK)
    return plain, (key.encode() if len(key) == 40 else None)


def connect(sock: zmq.Socket, address: str) -> bool:
    """Connect a client to a published address, trusting the server key it carries.

    A CURVE client is never connected to an address without a key (a daemon running
    without CURVE in a job that has it): logged, and False."""
    plain, key = split(address)
    if sock.getsockopt(zmq.MECHANISM) == zmq.CURVE and not sock.getsockopt(zmq.CURVE_SERVER):
        if key is None and _active is None:  # keys given by the caller (CurveKeys), server key too
            sock.connect(plain)
            return True
        if key is None:
            _refused_once(("keyless", plain), "handshake",
                          "not connecting to %s: it publishes no CURVE key and this process requires CURVE",
                          plain)
            return False
        sock.curve_serverkey = key  # read at connect(): each address may have its own server key
    sock.connect(plain)
    return True


# ----------------------------------------------------------------- refusals
_seen: set[tuple] = set()


def _refused_once(peer: tuple, reason: str, message: str, *args: object) -> None:
    REFUSED.labels("zmq", reason).inc()
    if peer in _seen:
        return
    if len(_seen) < _MAX_REMEMBERED:
        _seen.add(peer)
    log.warning(message, *args, extra={"event": "auth_refused", "reason": reason})


def _guard(ctx: zmq.Context) -> _HandshakeWatch:
    with _lock:
        pair = _guards.get(id(ctx))
        if pair is None:
            pair = _guards[id(ctx)] = (_ZapHandler(ctx), _HandshakeWatch(ctx))
        return pair[1]


class _ZapHandler(threading.Thread):
    """Answers libzmq's ZAP requests: a CURVE client is admitted iff its key is authorized."""

    def __init__(self, ctx: zmq.Context) -> None:
        super().__init__(name="curve-zap", daemon=True)
        self._stop_event = threading.Event()
        self._sock = ctx.socket(zmq.REP)
        self._sock.linger = 0
        self._sock.bind(_ZAP_ENDPOINT)  # bound here, so it exists before arm() returns
        self.start()

    def run(self) -> None:
        sock = self._sock
        try:
            while not self._stop_event.is_set():
                if not sock.poll(200):
                    continue
                msg = sock.recv_multipart()
                sock.send_multipart(self._answer(msg))
        finally:
            sock.close(linger=0)

    def _answer(self, msg: list[bytes]) -> list[bytes]:
        if len(msg) < 6:
            return [b"1.0", msg[1] if len(msg) > 1 else b"", b"400", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _identity, mechanism, *credentials = msg
        setup = _active
        peer_ip = address.decode(errors="replace")
        if mechanism == b"CURVE" and credentials and len(credentials[0]) == 32:
            key = z85.encode(credentials[0])
            role = setup.roles.get(key) if setup is not None else None
            if role is None and setup is not None and (fresh := _reread_for_unknown_key()) is not None:
                role = fresh.roles.get(key)  # authorized since the last read: a host added to the fleet
            try:
                edge = edges.edge_of(domain)
            except ValueError as exc:
                _refused_once((peer_ip, key, domain), "edge", "refused a CURVE client from %s: %s", peer_ip, exc)
                return [version, request_id, b"400", b"unknown socket", b"", b""]
            if role is not None and edges.admits(edge, role):
                return [version, request_id, b"200", b"OK", f"{role}:{key.decode()}".encode(), b""]
            if role is None:
                _refused_once((peer_ip, key), "unknown_key",
                              "refused a CURVE client from %s: key %s is not authorized", peer_ip, key.decode())
            else:
                _refused_once((peer_ip, key, edge), "role",
                              "refused a CURVE client from %s on %s: key %s speaks for %s; %s admits %s",
                              peer_ip, edge, key.decode(), role or "no role", edge,
                              ", ".join(sorted(edges.EDGES[edge] if edge else ())))
        else:
            _refused_once((peer_ip, mechanism), "mechanism",
                          "refused a %s client from %s: CURVE is required", mechanism.decode(errors="replace"),
                          peer_ip)
        return [version, request_id, b"400", b"not authorized", b"", b""]

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=2)


# libzmq's ZMQ_PROTOCOL_ERROR_ZMTP_* codes a refused handshake reports, in words.
_PROTOCOL_ERRORS = {0x11000001: "not this server's key (cryptographic error)",
                    0x11000002: "the client does not speak CURVE (mechanism mismatch)"}


def _handshake_failure(value: int) -> str:
    """A failed handshake's code in words: a ZMTP protocol error, or (no detail) the errno
    of a connection the client dropped mid-handshake, as a client without CURVE may."""
    if value in _PROTOCOL_ERRORS:
        return _PROTOCOL_ERRORS[value]
    if 0 < value < 0x10000000 and value in errno.errorcode:
        return f"the connection ended during the handshake ({errno.errorcode[value]}: {os.strerror(value)})"
    return f"libzmq code {value:#x}"


_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)


class _HandshakeWatch(threading.Thread):
    """Reads the monitor of every CURVE server socket of a context: a peer that does not
    speak CURVE, or encrypts to another server key, fails its handshake before ZAP."""

    def __init__(self, ctx: zmq.Context) -> None:
        super().__init__(name="curve-handshakes", daemon=True)
        self.ctx = ctx
        self._ids = itertools.count()
        self._new: queue.Queue[zmq.Socket] = queue.Queue()
        self._stop_event = threading.Event()
        self.start()

    def watch(self, sock: zmq.Socket) -> None:
        endpoint = f"inproc://rlfleet-handshakes-{id(self):x}-{next(self._ids)}"
        sock.monitor(endpoint, _HANDSHAKE_FAILED | zmq.EVENT_MONITOR_STOPPED)
        # Connected here, before the server can accept anyone, so no event is lost; the
        # queue hands the socket to the watcher thread (a full memory barrier, which is
        # how ZeroMQ allows a socket to change threads).
        mon = self.ctx.socket(zmq.PAIR)
        mon.connect(endpoint)
        self._new.put(mon)

    def run(self) -> None:
        poller, monitors = zmq.Poller(), []
        try:
            while not self._stop_event.is_set():
                while not self._new.empty():
                    mon = self._new.get()
                    poller.register(mon, zmq.POLLIN)
                    monitors.append(mon)
                for mon, _ in poller.poll(100):
                    event = recv_monitor_message(mon)
                    if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                        poller.unregister(mon)
                        monitors.remove(mon)
                        mon.close(linger=0)
                        continue
                    where = event["endpoint"].decode(errors="replace")
                    why = _handshake_failure(event["value"])
                    _refused_once((where, event["value"]), "handshake",
                                  "refused a connection on %s: handshake failed: %s", where, why)
        finally:
            for mon in monitors:
                mon.close(linger=0)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=2)
