"""etcd credentials against real etcd processes: TLS with --client-cert-auth (the
certificates `rlfleet run` makes, tools/run/credentials.py), and etcd users with auth
enabled by etcdctl. Also the same through the `rlfleet` CLI's --etcd-* flags."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlfleet.common.control.etcd_auth import EtcdCredentials, StoreAuthError, open_store
from rlfleet.common.control.store import StoreUnavailable
from rlfleet.common.secret_files import SecretFileError, write_private
from rlfleet.tools.exit_codes import Exit
from rlfleet.tools.run.credentials import make_etcd_tls
from rlfleet.tools.run.etcd_local import EtcdCluster


@pytest.fixture
def tls_etcd(tmp_path):
    tls = make_etcd_tls(tmp_path / "pki")
    cluster = EtcdCluster(1, base_dir=tmp_path / "etcd", tls=tls).start()
    yield cluster, tls
    cluster.stop()


def test_a_client_certificate_is_needed_and_enough(tls_etcd):
    cluster, tls = tls_etcd
    store = open_store(cluster.endpoints_arg, creds=tls.client_credentials())
    try:
        store.put("/rlfleet/t/x", {"v": 1})
        assert store.get("/rlfleet/t/x").value == {"v": 1}
        lease = store.grant_lease(3)
        assert store.refresh_lease(lease) > 0  # the keep-alive stream carries the TLS channel too
        watch = store.watch_prefix("/rlfleet/t/")
        store.put("/rlfleet/t/x", 2)
        event = watch.get(timeout=10)
        watch.cancel()
        assert event is not None and event.value == 2
    finally:
        store.close()
    # TLS but no client certificate: etcd refuses the handshake, and the error says so.
    no_cert = open_store(cluster.endpoints_arg, creds=EtcdCredentials(cacert=str(tls.ca)))
    with pytest.raises(StoreUnavailable, match="TLS handshake failed"):
        no_cert.get("/rlfleet/t/x")
    no_cert.close()
    # No TLS at all: refused too, with a hint.
    plain = open_store(cluster.endpoints_arg, creds=EtcdCredentials())
    with pytest.raises(StoreUnavailable, match="does etcd serve TLS"):
        plain.get("/rlfleet/t/x")
    plain.close()


def test_a_client_key_others_can_read_is_refused(tls_etcd, tmp_path):
    _, tls = tls_etcd
    os.chmod(tls.client_key, 0o640)
    with pytest.raises(SecretFileError, match="mode 0640"):
        open_store("127.0.0.1:2379", creds=tls.client_credentials())


def _etcdctl(cluster: EtcdCluster, *args: str) -> None:
    done = subprocess.run(["etcdctl", "--endpoints", cluster.endpoints_arg, *args], capture_output=True,
                          text=True, env={**os.environ, "ETCDCTL_API": "3"}, timeout=30)
    assert done.returncode == 0, done.stderr


def test_etcd_users_right_password_in_wrong_password_out(etcd, tmp_path):
    # What docs/operations/security.md tells an operator to run: root, a job user with a role on
    # the /rlfleet/ prefix, then auth on.
    _etcdctl(etcd, "user", "add", "root", "--new-user-password=root-pw")
    _etcdctl(etcd, "user", "add", "fleet", "--new-user-password=fleet-pw")
    _etcdctl(etcd, "role", "add", "fleet")
    _etcdctl(etcd, "role", "grant-permission", "fleet", "--prefix=true", "readwrite", "/rlfleet/")
    _etcdctl(etcd, "user", "grant-role", "fleet", "fleet")
    _etcdctl(etcd, "auth", "enable")
    write_private(tmp_path / "good", b"fleet-pw\n")
    write_private(tmp_path / "bad", b"guess\n")

    store = open_store(etcd.endpoints_arg, creds=EtcdCredentials(user="fleet", password_file=str(tmp_path / "good")))
    try:
        store.put("/rlfleet/t/x", 1)
        assert store.get("/rlfleet/t/x").value == 1
        assert store.refresh_lease(store.grant_lease(3)) > 0
        watch = store.watch_prefix("/rlfleet/t/")
        store.put("/rlfleet/t/x", 2)
        event = watch.get(timeout=10)
        watch.cancel()
        assert event is not None and event.value == 2
        with pytest.raises(StoreAuthError, match="permission denied"):  # outside the role's prefix
            store.put("/elsewhere", 1)
        # etcd restarted forgets its tokens: the store logs in again by itself.
        etcd.stop_member(etcd.members[0])
        etcd.start_member(etcd.members[0])
        assert store.get("/rlfleet/t/x").value == 2
    finally:
        store.close()
    for creds, words in ((EtcdCredentials(user="fleet", password_file=str(tmp_path / "bad")), "invalid user ID or password"),
                         (EtcdCredentials(), "user name is empty")):
        other = open_store(etcd.endpoints_arg, creds=creds)
        with pytest.raises(StoreAuthError, match=words):
            other.get("/rlfleet/t/x")
        other.close()
    os.chmod(tmp_path / "good", 0o644)
    with pytest.raises(SecretFileError, match="chmod 600"):
        open_store(etcd.endpoints_arg, creds=EtcdCredentials(user="fleet", password_file=str(tmp_path / "good")))


def test_the_cli_takes_credentials_from_flags_and_environment(tls_etcd):
    cluster, tls = tls_etcd
    open_store(cluster.endpoints_arg, creds=tls.client_credentials()).put("/rlfleet/cli/spec", {"a": 1})
    cli = [sys.executable, "-m", "rlfleet.tools.cli", "keys", "/rlfleet/cli/", "--etcd", cluster.endpoints_arg]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_ETCD_")}
    flags = ["--etcd-cacert", str(tls.ca), "--etcd-cert", str(tls.client_cert), "--etcd-key", str(tls.client_key)]
    by_flags = subprocess.run(cli + flags, capture_output=True, text=True, env=env, timeout=60)
    assert by_flags.returncode == 0 and '/rlfleet/cli/spec\t{"a": 1}' in by_flags.stdout, by_flags.stderr
    assert f"--cacert={tls.ca}" in by_flags.stderr  # the etcdctl equivalent has the credentials too
    by_env = subprocess.run(cli, capture_output=True, text=True, timeout=60,
                            env={**env, **tls.client_credentials().env()})
    assert by_env.returncode == 0 and "/rlfleet/cli/spec" in by_env.stdout, by_env.stderr
    refused = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=60)
    assert refused.returncode == Exit.ETCD_UNREACHABLE and "does etcd serve TLS" in refused.stderr, refused.stderr
    half = subprocess.run(cli + ["--etcd-cert", str(tls.client_cert)], capture_output=True, text=True, env=env,
                          timeout=60)
    assert half.returncode == Exit.BAD_SPEC and "needs its key" in half.stderr, half.stderr
