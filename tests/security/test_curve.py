"""CURVE for a whole process (common/wire/curve.py): real sockets over loopback TCP. The
process-wide setup is switched on per test and off again after it. A host's keys authorized
while a server runs, and `rlfleet curve-probe` (tools/ctl/curve.py), which reads each
handshake's outcome from the client's side."""

from __future__ import annotations

import json
import logging
import os

import pytest
import zmq
from click.testing import CliRunner

from rlfleet.common.secret_files import SecretFileError
from rlfleet.common.spec.placement import ROLES
from rlfleet.common.wire import curve
from rlfleet.common.wire.edges import EDGES
from rlfleet.common.wire.messages import Abort
from rlfleet.common.wire.sockets import CurveKeys, PeerTimeout, RequestClient, RequestServer
from rlfleet.tools.cli import main
from rlfleet.tools.ctl.curve import authorize, probe

LOCAL = "tcp://127.0.0.1:0"


@pytest.fixture
def job_keys(tmp_path):
    curve.create_keys(tmp_path / "job")
    setup = curve.CurveSetup.load(tmp_path / "job")
    curve.configure(setup)
    yield setup
    curve.configure(None)


def _refused(reason: str) -> float:
    return curve.REFUSED.labels("zmq", reason)._value.get()


def _serve_one(server: RequestServer, timeout_s: float) -> bool:
    got = server.recv(timeout_s)
    if got is None:
        return False
    server.reply(got[0], got[1], got[2])
    return True


def test_a_job_client_reaches_a_job_server_and_the_endpoint_carries_the_key(job_keys):
    with RequestServer(LOCAL) as server, RequestClient(server.endpoint) as client:
        assert server.endpoint.endswith(curve.KEY_MARK + job_keys.public.decode())
        rid = client.send(Abort("a"))
        assert _serve_one(server, 5.0)
        assert client.poll_replies(5.0) == [(rid, Abort("a"))]


def test_clients_without_the_jobs_keys_are_refused_and_logged(job_keys, caplog):
    caplog.set_level(logging.WARNING, logger="rlfleet.auth")
    unknown, handshake = _refused("unknown_key"), _refused("handshake")
    with RequestServer(LOCAL) as server:
        plain_address, server_key = curve.split(server.endpoint)
        assert server_key == job_keys.public
        # A stranger that knows the server's public key (etcd shows it) but whose own key
        # is not authorized: the handshake reaches ZAP, which says no.
        stranger = CurveKeys.generate(server_public=server_key)
        plain = zmq.Context.instance().socket(zmq.DEALER)  # no CURVE at all
        try:
            plain.connect(plain_address)
            plain.send_multipart([b"r1", b"junk"])
            with RequestClient(server.endpoint, curve=stranger) as client:
                with pytest.raises(PeerTimeout):
                    client.request(Abort("x"), timeout_s=1.0)
            assert server.recv(0.5) is None  # nothing got through, not even the junk
        finally:
            plain.close(linger=0)
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"key {stranger.public.decode()} is not authorized" in m for m in messages), messages
    assert any("does not speak CURVE" in m for m in messages), messages
    assert _refused("unknown_key") > unknown and _refused("handshake") > handshake


def test_a_curve_client_never_connects_to_an_address_without_a_key(job_keys, caplog):
    caplog.set_level(logging.WARNING, logger="rlfleet.auth")
    with RequestClient("tcp://127.0.0.1:9") as client:
        with pytest.raises(PeerTimeout):
            client.send(Abort("x"), timeout_s=0.2)
    assert any("publishes no CURVE key" in r.getMessage() for r in caplog.records)


def test_a_secret_file_others_can_read_is_refused(tmp_path):
    curve.create_keys(tmp_path / "k")
    os.chmod(tmp_path / "k" / curve.SECRET_FILE, 0o644)
    with pytest.raises(SecretFileError, match="mode 0644.*chmod 600"):
        curve.CurveSetup.load(tmp_path / "k")


def test_an_empty_allow_list_is_an_error(tmp_path):
    curve.create_keys(tmp_path / "k")
    for key in (tmp_path / "k" / curve.AUTHORIZED_DIR).glob("*.key"):
        key.unlink()
    with pytest.raises(curve.CurveError, match="no public key"):
        curve.CurveSetup.load(tmp_path / "k")


def test_reload_admits_a_key_added_to_authorized(job_keys, tmp_path):
    other = tmp_path / "other"
    curve.create_keys(other)
    other_keys = curve.CurveSetup.load(other)
    (tmp_path / "job" / curve.AUTHORIZED_DIR / "other.key").write_bytes(
        (other / curve.AUTHORIZED_DIR / "daemon.key").read_bytes())
    assert other_keys.public not in curve.active().authorized
    assert curve.reload_authorized() == "CURVE: 2 authorized key(s)"
    with RequestServer(LOCAL) as server:
        plain_address, key = curve.split(server.endpoint)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        try:
            sock.curve_publickey, sock.curve_secretkey = other_keys.public, other_keys.secret
            sock.curve_serverkey = key
            sock.connect(plain_address)
            sock.send_multipart([b"r1", b"junk"])  # a malformed frame: counted, proves delivery
            assert server.recv(2.0) is None
            assert sum(server.rejected.values()) == 1
        finally:
            sock.close(linger=0)


# ----------------------------------------------------------------- roles and edges
@pytest.fixture
def role_keys(tmp_path):
    """A key pair per role in one directory, as `rlfleet run` makes them; the process
    serves with the trainer's pair. Returns {role: CurveSetup of that role's pair}."""
    for role in ROLES:
        curve.create_keys(tmp_path / "job", name=role, role=role)
    setups = {role: curve.CurveSetup.load(tmp_path / "job", role) for role in ROLES}
    curve.configure(setups["trainer"])
    yield setups
    curve.configure(None)


def _admitted(server: RequestServer, setup: curve.CurveSetup) -> bool:
    _, server_key = curve.split(server.endpoint)
    keys = CurveKeys(setup.public, setup.secret, server_public=server_key)
    with RequestClient(server.endpoint, curve=keys) as client:
        try:  # refused by ZAP: the handshake never completes, so no connected server
            rid = client.send(Abort("probe"), timeout_s=2.0)
        except PeerTimeout:
            return False
        if not _serve_one(server, 1.5):
            return False
        return client.poll_replies(5.0) == [(rid, Abort("probe"))]


def test_each_socket_admits_exactly_the_roles_of_its_edge(role_keys, caplog):
    """Every (role, edge) pair: the 4 edges of common/wire/edges.py admitted, the 17 others
    refused at the handshake with a log line naming the role and the edge."""
    caplog.set_level(logging.WARNING, logger="rlfleet.auth")
    assert len({role_keys[r].public for r in ROLES}) == len(ROLES)  # a pair each
    refused_before = _refused("role")
    seen = {}
    for edge in EDGES:
        with RequestServer(LOCAL, edge=edge) as server:
            for role in ROLES:
                seen[edge, role] = _admitted(server, role_keys[role])
    assert {pair for pair, ok in seen.items() if ok} == {(e, r) for e, roles in EDGES.items() for r in roles}
    forbidden = sum(1 for ok in seen.values() if not ok)
    assert forbidden == len(EDGES) * len(ROLES) - sum(len(r) for r in EDGES.values())
    assert _refused("role") - refused_before == forbidden
    messages = [r.getMessage() for r in caplog.records]
    env_key = role_keys["env-host"].public.decode()
    assert any(f"on trainer-trajectories: key {env_key} speaks for env-host; trainer-trajectories admits "
               "reward-host" in m for m in messages), messages


def test_a_key_authorized_under_two_roles_or_a_folder_that_is_no_role_is_refused(tmp_path):
    curve.create_keys(tmp_path / "k", name="h1", role="env-host")
    key = (tmp_path / "k" / "authorized" / "env-host" / "h1.key").read_bytes()
    (tmp_path / "k" / "authorized" / "reward-host").mkdir()
    (tmp_path / "k" / "authorized" / "reward-host" / "h1.key").write_bytes(key)
    with pytest.raises(curve.CurveError, match="authorized for two roles"):
        curve.CurveSetup.load(tmp_path / "k", "env-host")
    (tmp_path / "k" / "authorized" / "reward-host" / "h1.key").unlink()
    (tmp_path / "k" / "authorized" / "admins").mkdir()
    with pytest.raises(curve.CurveError, match="admins: not a role"):
        curve.CurveSetup.load(tmp_path / "k", "env-host")


def test_an_unknown_edge_is_an_error_at_bind():
    with pytest.raises(ValueError, match="unknown socket edge 'trainer'"):
        RequestServer(LOCAL, edge="trainer")


# ----------------------------------------------------------------- a host authorized while the server runs
def _new_host_pair(directory, role: str) -> dict[str, tuple[bytes, bytes]]:
    """A key pair of ``role`` made on another host (``directory``), as curve-probe holds it."""
    curve.create_keys(directory, name="new-host", role=role)
    return {role: curve.read_pair(directory / curve.secret_file(role))}


def _authorize_without_reload(job_dir, role: str, pair: dict[str, tuple[bytes, bytes]]) -> None:
    """What `rlfleet curve-authorize` writes on the server's host; nobody sends SIGHUP."""
    assert authorize(job_dir, {"new-host": {role: pair[role][0].decode()}})


def test_a_key_authorized_after_start_is_admitted_at_its_next_handshake(role_keys, tmp_path):
    new = _new_host_pair(tmp_path / "new", "env-host")
    with RequestServer(LOCAL, edge="rollout-requests") as server:
        assert new["env-host"][0] not in curve.active().roles
        _authorize_without_reload(tmp_path / "job", "env-host", new)
        assert probe(new, [server.endpoint], 10.0) == {server.endpoint: {"env-host": "admitted"}}
    assert curve.active().roles[new["env-host"][0]] == "env-host"


class _CountedReads:
    """load_authorized, counting its calls."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        self._load = curve.load_authorized
        monkeypatch.setattr(curve, "load_authorized", self)

    def __call__(self, directory):
        self.calls += 1
        return self._load(directory)


def test_a_key_authorized_after_start_for_another_role_is_refused_by_its_edge(role_keys, tmp_path, monkeypatch,
                                                                              caplog):
    caplog.set_level(logging.WARNING, logger="rlfleet.auth")
    reads, by_role = _CountedReads(monkeypatch), _refused("role")
    new = _new_host_pair(tmp_path / "new", "reward-host")
    _authorize_without_reload(tmp_path / "job", "reward-host", new)
    with RequestServer(LOCAL, edge="rollout-requests") as server:
        assert probe(new, [server.endpoint], 10.0) == {server.endpoint: {"reward-host": "refused (auth)"}}
    assert reads.calls == 1 and _refused("role") == by_role + 1
    key = new["reward-host"][0].decode()
    assert any(f"key {key} speaks for reward-host; rollout-requests admits env-host, repack-manager" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_unknown_keys_re_read_authorized_only_when_it_changed(role_keys, tmp_path, monkeypatch):
    """Strangers' keys (on no server's disk) cost a listing of authorized/, never a read;
    a key authorized between two of them is read at its own handshake."""
    reads, unknown = _CountedReads(monkeypatch), _refused("unknown_key")
    strangers = [_new_host_pair(tmp_path / f"stranger{i}", "env-host") for i in range(2)]
    new = _new_host_pair(tmp_path / "new", "env-host")
    with RequestServer(LOCAL, edge="rollout-requests") as server:
        for stranger in strangers:
            assert probe(stranger, [server.endpoint], 10.0) == {server.endpoint: {"env-host": "refused (auth)"}}
        assert reads.calls == 0
        _authorize_without_reload(tmp_path / "job", "env-host", new)
        assert probe(new, [server.endpoint], 10.0) == {server.endpoint: {"env-host": "admitted"}}
        assert probe(strangers[0], [server.endpoint], 10.0) == {server.endpoint: {"env-host": "refused (auth)"}}
        assert probe({"env-host": (role_keys["env-host"].public, role_keys["env-host"].secret)},
                     [server.endpoint], 10.0) == {server.endpoint: {"env-host": "admitted"}}  # known: no read
    assert reads.calls == 1 and _refused("unknown_key") == unknown + 3


def test_a_failed_re_read_keeps_the_current_keys_and_is_logged_once(role_keys, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="rlfleet.auth")
    reads = _CountedReads(monkeypatch)
    before = curve.active()
    (tmp_path / "job" / curve.AUTHORIZED_DIR / "admins").mkdir()  # not a role: the folder cannot be read
    new = _new_host_pair(tmp_path / "new", "env-host")
    _authorize_without_reload(tmp_path / "job", "env-host", new)
    env_host = {"env-host": (role_keys["env-host"].public, role_keys["env-host"].secret)}
    with RequestServer(LOCAL, edge="rollout-requests") as server:
        for _ in range(2):  # the second finds the folder as the failed read left it: no read
            assert probe(new, [server.endpoint], 10.0) == {server.endpoint: {"env-host": "refused (auth)"}}
        assert probe(env_host, [server.endpoint], 10.0) == {server.endpoint: {"env-host": "admitted"}}
        assert reads.calls == 1 and curve.active() is before
        (tmp_path / "job" / curve.AUTHORIZED_DIR / "admins").rmdir()  # repaired: the key's next handshake reads
        assert probe(new, [server.endpoint], 10.0) == {server.endpoint: {"env-host": "admitted"}}
    assert reads.calls == 2
    failures = [r.getMessage() for r in caplog.records if "re-reading them for an unknown key failed" in r.getMessage()]
    assert len(failures) == 1 and "admins: not a role" in failures[0], failures


# ----------------------------------------------------------------- rlfleet curve-probe
def test_curve_probe_reports_each_roles_handshake_on_each_address(role_keys, tmp_path):
    job = tmp_path / "job"
    with RequestServer(LOCAL, edge="rollout-requests") as rollout, \
            RequestServer(LOCAL, edge="trainer-trajectories") as trainer:
        addresses = {rollout.endpoint: "rollout-requests", trainer.endpoint: "trainer-trajectories"}
        result = CliRunner().invoke(main, ["curve-probe", str(job), *addresses, "--json", "--timeout", "10"],
                                    catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert json.loads(result.output) == {
            address: {role: "admitted" if role in EDGES[edge] else "refused (auth)" for role in ROLES}
            for address, edge in addresses.items()}
        table = CliRunner().invoke(main, ["curve-probe", str(job), rollout.endpoint, "--role", "env-host",
                                          "--role", "trainer"], catch_exceptions=False)
    assert table.exit_code == 0, table.output
    rows = [line.split() for line in table.output.splitlines()]
    assert rows == [["ADDRESS", "ROLE", "RESULT"], [rollout.endpoint, "env-host", "admitted"],
                    [rollout.endpoint, "trainer", "refused", "(auth)"]]
    keyless = CliRunner().invoke(main, ["curve-probe", str(job), "tcp://127.0.0.1:9"])
    assert keyless.exit_code == 2 and "carries no CURVE server key" in keyless.output, keyless.output
