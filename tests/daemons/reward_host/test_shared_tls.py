"""The shared reward service over HTTPS (issue 28): `rlfleet reward-service` as a real
subprocess on a real port, serving the certificate that the job's CA issued
(tools/credentials.make_etcd_tls, the CA `rlfleet run` makes), and the remote_http
backend of a reward-host scoring through it with that CA and the token. A client that
trusts another CA, one without the token, a plain-HTTP client and one without the client
certificate asked for are refused; bad TLS files and plain HTTP off loopback are spec
errors naming the key and the file."""

from __future__ import annotations

import http.client
import os
import ssl
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rlfleet.common.secret_files import write_private
from rlfleet.common.spec.errors import SpecError
from rlfleet.daemons.reward_host.remote.backend import RemoteBackend
from rlfleet.daemons.reward_host.remote.config import RemoteHttpConfig, TlsFileError
from rlfleet.daemons.reward_host.shared.spec import parse_service_spec
from rlfleet.tools.run.credentials import EtcdTls, make_etcd_tls

from .test_remote import collect, expected, job
from .test_shared_service import SERVICE_SPEC, SharedService, body, cli, post

TOKEN = "Bearer s3cret"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> tuple[EtcdTls, EtcdTls]:
    """The job's CA with a server certificate for 127.0.0.1/localhost and a client
    certificate; and another CA with its own, which nobody here trusts."""
    root = tmp_path_factory.mktemp("pki")
    return make_etcd_tls(root / "job"), make_etcd_tls(root / "other")


def tls_keys(tls: EtcdTls, client_ca: Path | None = None) -> str:
    keys = f'cert_file = "{tls.server_cert}"\nkey_file = "{tls.server_key}"\n'
    return keys + (f'client_ca_file = "{client_ca}"\n' if client_ca else "")


@pytest.fixture
def token(tmp_path) -> Path:
    path = tmp_path / "token"
    write_private(path, (TOKEN + "\n").encode())
    return path


@pytest.fixture
def https_service(tmp_path, pki, token):
    started: list[SharedService] = []

    def start(client_ca: Path | None = None) -> SharedService:
        svc = SharedService(tmp_path, service=f'auth_secret_file = "{token}"',
                            tls=tls_keys(pki[0], client_ca))
        started.append(svc)
        return svc

    yield start
    for s in started:
        s.close()


def trusting(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


def test_a_reward_host_backend_scores_over_https_with_the_jobs_ca_and_token(https_service, pki, token,
                                                                             backends):
    svc = https_service()
    assert svc.url.startswith("https://127.0.0.1:")
    b = backends(endpoints=svc.url, ca_file=str(pki[0].ca), auth_secret_file=str(token))
    for i in range(6):
        b.submit(job(i, right=i % 2 == 0))
    got = {o.key: o for o in collect(b, 6)}
    assert {k: (o.reward, o.error) for k, o in got.items()} == \
        {f"p{i}": (expected(i, i % 2 == 0), "") for i in range(6)}
    stats = svc.stats({"Authorization": TOKEN}, context=trusting(pki[0].ca))
    assert stats["tenants"][""]["requests"]["scored"] == 6
    assert svc.close().startswith("reward service stopped: (none):")


def test_a_client_trusting_another_ca_is_refused(https_service, pki, token, backends):
    svc = https_service()
    b = backends(endpoints=svc.url, ca_file=str(pki[1].ca), auth_secret_file=str(token), retry={"max_attempts": 1})
    b.submit(job(1))
    [o] = collect(b, 1)
    assert o.error.startswith(f"1 attempts failed; last: {svc.url}: ConnectError: ") and \
        "CERTIFICATE_VERIFY_FAILED" in o.error, o.error
    # Nor does the system's trust store know the job's CA.
    with pytest.raises(urllib.error.URLError) as exc:
        post(svc.url, body(1, "t"), headers={"Authorization": TOKEN}, context=ssl.create_default_context())
    assert isinstance(exc.value.reason, ssl.SSLCertVerificationError)
    # The token never left: nothing reached the handlers.
    assert svc.stats({"Authorization": TOKEN}, context=trusting(pki[0].ca))["tenants"] == {}
    assert 'rlfleet_auth_refused_total{reason="tls_handshake",transport="https"} 2.0' in \
        svc.metrics({"Authorization": TOKEN}, context=trusting(pki[0].ca))
    assert "TLS handshake failed" in svc.log.read_text()


def test_a_client_without_the_token_is_refused_over_https(https_service, pki):
    svc = https_service()
    ca = trusting(pki[0].ca)
    assert post(svc.url, body(0, "t"), context=ca) == (401, {"error": "wrong or missing Authorization header"})
    assert post(svc.url, body(0, "t"), headers={"Authorization": "Bearer guess"}, context=ca)[0] == 401
    with pytest.raises(urllib.error.HTTPError) as exc:
        svc.stats(context=ca)
    assert exc.value.code == 401
    assert post(svc.url, body(0, "t"), headers={"Authorization": TOKEN}, context=ca)[0] == 200


def test_a_plain_http_client_gets_nothing_from_the_tls_port(https_service, pki, token, backends):
    svc = https_service()
    conn = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=10)
    with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError, http.client.BadStatusLine)):
        conn.request("POST", "/score", body=b"{}", headers={"Authorization": TOKEN})
        conn.getresponse()
    conn.close()
    plain = svc.url.replace("https://", "http://", 1)  # loopback: the config allows the token
    b = backends(endpoints=plain, auth_secret_file=str(token), retry={"max_attempts": 1})
    b.submit(job(2))
    [o] = collect(b, 1)
    assert o.error.startswith(f"1 attempts failed; last: {plain}: ") and o.reward == 0.0, o.error
    assert "TLS handshake failed (HTTP_REQUEST)" in svc.log.read_text()
    # Still serving HTTPS.
    assert post(svc.url, body(2, "t"), headers={"Authorization": TOKEN}, context=trusting(pki[0].ca))[0] == 200


def test_a_client_certificate_from_the_ca_when_the_service_asks_for_one(https_service, pki, token, backends):
    job_ca = pki[0]
    svc = https_service(client_ca=job_ca.ca)
    once = {"ca_file": str(job_ca.ca), "auth_secret_file": str(token), "retry": {"max_attempts": 1}}
    without = backends(endpoints=svc.url, **once)
    without.submit(job(3))
    [o] = collect(without, 1)
    assert o.error.startswith("1 attempts failed; last: ") and o.reward == 0.0, o.error
    foreign = backends(endpoints=svc.url, **once, client_cert_file=str(pki[1].client_cert),
                       client_key_file=str(pki[1].client_key))
    foreign.submit(job(3))
    assert collect(foreign, 1)[0].error.startswith("1 attempts failed; last: ")
    mine = trusting(job_ca.ca)
    mine.load_cert_chain(job_ca.client_cert, job_ca.client_key)
    assert svc.stats({"Authorization": TOKEN}, context=mine)["tenants"] == {}  # refused before any request
    with_cert = backends(endpoints=svc.url, **once, client_cert_file=str(job_ca.client_cert),
                         client_key_file=str(job_ca.client_key))
    with_cert.submit(job(3))
    [o] = collect(with_cert, 1)
    assert (o.reward, o.error) == (expected(3), "")


def test_an_unusable_ca_file_stops_the_backend_at_start_with_its_path(tmp_path):
    missing = tmp_path / "ca.crt"
    with pytest.raises(TlsFileError, match=f"^ca_file: CA certificate {missing}: cannot read: No such file"):
        RemoteBackend(RemoteHttpConfig(endpoints="https://127.0.0.1:9/score", ca_file=str(missing)))
    missing.write_text("not a certificate\n")
    with pytest.raises(TlsFileError, match=f"^ca_file: CA certificate {missing}: no PEM certificate in it"):
        RemoteBackend(RemoteHttpConfig(endpoints="https://127.0.0.1:9/score", ca_file=str(missing)))


# ----------------------------------------------------------------------------- the spec
PIPELINE = '[pipeline]\n[[pipeline.stages]]\nname = "check"\nworker = { kind = "rule_pool" }\n'


def spec_errors(tls: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_service_spec(tomllib.loads(f"[tls]\n{tls}\n{PIPELINE}"), "svc.toml")
    return [e.removeprefix("svc.toml: ") for e in info.value.errors]


def test_tls_files_are_checked_when_the_spec_is_validated(tmp_path, pki):
    job_ca, other = pki
    cert, key, ca = job_ca.server_cert, job_ca.server_key, job_ca.ca
    nothing = tmp_path / "none.pem"
    not_a_key, loose, garbled = tmp_path / "cert-as.key", tmp_path / "loose.key", tmp_path / "garbled.crt"
    for path, content, mode in ((not_a_key, cert.read_bytes(), 0o600), (loose, key.read_bytes(), 0o644),
                                (garbled, b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n", 0o644)):
        path.write_bytes(content)
        os.chmod(path, mode)
    for cert_file, key_file, ca_file, error in [
        (nothing, key, None, f"tls.cert_file: certificate {nothing}: cannot read: No such file or directory"),
        (cert, nothing, None, f"tls.key_file: private key {nothing}: cannot open: No such file or directory"),
        (key, key, None, f"tls.cert_file: certificate {key}: no PEM certificate in it"),
        (cert, not_a_key, None, f"tls.key_file: private key {not_a_key}: no PEM private key in it"),
        (cert, other.server_key, None,
         f"tls.key_file: private key {other.server_key}: not the key of tls.cert_file {cert}"),
        (cert, loose, None, f"tls.key_file: private key {loose}: mode 0644 lets group or others read it; "
                            f"it must be 0600 or stricter (chmod 600 {loose})"),
        (cert, key, garbled, f"tls.client_ca_file: CA certificate {garbled}: unusable ("),  # OpenSSL's reason
        (cert, key, nothing, f"tls.client_ca_file: CA certificate {nothing}: cannot read: No such file or directory"),
        (cert, key, ca, None),
    ]:
        keys = f'cert_file = "{cert_file}"\nkey_file = "{key_file}"\n'
        keys += f'client_ca_file = "{ca_file}"\n' if ca_file else ""
        if error is None:
            assert parse_service_spec(tomllib.loads(f"[tls]\n{keys}{PIPELINE}")).tls is not None
            continue
        got = spec_errors(keys)
        assert len(got) == 1 and got[0].startswith(error) and (error.endswith("(") or got[0] == error), got
    assert spec_errors('cert_file = "server.crt"\nverify = true') == [
        "tls.cert_file: must be an absolute path, got 'server.crt'",
        "tls.key_file: required key missing",
        "tls.verify: unknown key",
    ]


def test_plain_http_is_served_on_loopback_only(tmp_path, pki):
    spec = tmp_path / "service.toml"
    spec.write_text(SERVICE_SPEC.format(service="", judge_s=0.1))
    for check in (("--check",), ()):
        refused = cli("--spec", str(spec), "--listen", "0.0.0.0:0", *check)
        assert refused.returncode == 2 and refused.stdout == ""
        assert refused.stderr.strip().splitlines()[-1].startswith(
            "--listen 0.0.0.0: not a loopback address, and the spec has no [tls]: plain HTTP would carry "
            "the token and the trajectories in clear"), refused.stderr
    assert cli("--spec", str(spec), "--listen", "[::1]:0", "--check").returncode == 0
    assert cli("--spec", str(spec), "--listen", "localhost:0", "--check").returncode == 0
    spec.write_text(SERVICE_SPEC.format(service=f"\n[tls]\n{tls_keys(pki[0], pki[0].ca)}", judge_s=0.1))
    ok = cli("--spec", str(spec), "--listen", "0.0.0.0:0", "--check")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.endswith("scaling timeout_aware; https, client certificates)\n")
