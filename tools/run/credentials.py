"""The credentials `rlfleet run` makes for one run (docs/operations/security.md): a private CA with
a server certificate for its etcd and a client certificate for everyone else, the
job's CURVE key pair, and the relay's job secret. Nothing to set up, nothing reused
across runs: they live in the run directory and die with it.
``RunSecurity`` is what a run does with them: the environment its daemons get, what it
presents to etcd, the spec it submits (a secure run requires CURVE of every daemon).

Certificates come from the `openssl` command line (one call each, EC P-256), so no
Python crypto package is needed. On a cluster the deployment makes its own with the
same commands (docs/operations/security.md).
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from rlfleet.common.control.etcd_auth import ENV as ETCD_ENV
from rlfleet.common.control.etcd_auth import EtcdCredentials
from rlfleet.common.job_secret import ENV_VAR as JOB_SECRET_ENV
from rlfleet.common.secret_files import write_private
from rlfleet.common.spec.job import JobSpec
from rlfleet.common.spec.placement import ROLES
from rlfleet.common.wire import curve

CERT_DAYS = 30  # a run's certificates outlive any run, and are worthless after it
_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-noenc"]


@dataclass(frozen=True)
class EtcdTls:
    """What an etcd server needs for TLS with client-certificate authentication, and the
    client side that every process of the run presents."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def client_credentials(self) -> EtcdCredentials:
        return EtcdCredentials(cacert=str(self.ca), cert=str(self.client_cert), key=str(self.client_key))


def _openssl(*args: str) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise FileNotFoundError("openssl is not installed (apt-get install openssl), or run with --insecure")
    done = subprocess.run([exe, *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {done.stderr.strip()[-500:]}")


def make_etcd_tls(directory: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> EtcdTls:
    """A CA, etcd's server certificate (for ``hosts``) and one client certificate."""
    d = directory
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    tls = EtcdTls(d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt", d / "client.key")
    ca_key = d / "ca.key"
    _openssl("req", "-x509", *_EC, "-keyout", str(ca_key), "-out", str(tls.ca), "-days", str(CERT_DAYS),
             "-subj", "/CN=rlfleet run CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    sans = ",".join(f"IP:{h}" if h.replace(".", "").isdigit() or ":" in h else f"DNS:{h}" for h in hosts)
    for cert, key, cn, usage in ((tls.server_cert, tls.server_key, "etcd", "serverAuth"),
                                 (tls.client_cert, tls.client_key, "rlfleet", "clientAuth")):
        extra = ["-addext", f"subjectAltName={sans}"] if usage == "serverAuth" else []
        _openssl("req", "-x509", *_EC, "-keyout", str(key), "-out", str(cert), "-days", str(CERT_DAYS),
                 "-CA", str(tls.ca), "-CAkey", str(ca_key), "-subj", f"/CN={cn}",
                 "-addext", "basicConstraints=critical,CA:FALSE", "-addext", f"extendedKeyUsage={usage}", *extra)
    for key in (ca_key, tls.server_key, tls.client_key):
        os.chmod(key, 0o600)
    ca_key.unlink()  # nothing else will be signed: a CA key left on disk could only do harm
    return tls


def make_job_secret(path: Path) -> Path:
    """The relay's job secret: 32 random bytes, base64, in a 0600 file."""
    write_private(path, base64.b64encode(os.urandom(32)) + b"\n")
    return path


@dataclass(frozen=True)
class RunCredentials:
    """Everything `rlfleet run` hands its daemons, as the environment they read it from."""

    etcd_tls: EtcdTls | None
    curve_dir: Path
    job_secret: Path

    @classmethod
    def create(cls, directory: Path, private_etcd: bool) -> RunCredentials:
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        tls = make_etcd_tls(directory / "etcd") if private_etcd else None
        for role in ROLES:  # one pair per role: a daemon can speak only for its own (common/wire/edges.py)
            curve.create_keys(directory / "curve", name=role, role=role)
        return cls(tls, directory / "curve", make_job_secret(directory / "job.secret"))

    def env(self) -> dict[str, str]:
        env = {curve.ENV_DIR: str(self.curve_dir.resolve()), JOB_SECRET_ENV: str(self.job_secret.resolve())}
        if self.etcd_tls is not None:
            env.update(self.etcd_tls.client_credentials().env())
        return env


@dataclass
class RunSecurity:
    """What one run presents and requires. ``secure``: TLS etcd with client certificates
    (the private one), CURVE and the relay's job secret, all made for this run; `rlfleet
    run` defaults to it. ``etcd_creds``: for an --etcd given, from flags and environment."""

    spec: JobSpec
    secure: bool
    etcd_arg: str | None
    etcd_creds: EtcdCredentials
    credentials: RunCredentials | None = None

    @property
    def relay_auth(self) -> bool:
        """The relay's chunk transport is authenticated by the job secret over TCP only."""
        return self.secure and self.spec.relay.transport == "tcp"

    @property
    def etcd_tls(self) -> EtcdTls | None:
        return self.credentials.etcd_tls if self.credentials is not None else None

    def make(self, run_dir: Path) -> str:
        """This run's CA and certificates, CURVE keys and job secret; a sentence for the log."""
        started = time.monotonic()
        self.credentials = RunCredentials.create(run_dir / "credentials", private_etcd=not self.etcd_arg)
        etcd = "etcd over TLS with client certificates, " if self.credentials.etcd_tls else ""
        relay = ("relay authenticated" if self.relay_auth else
                 "relay NOT authenticated (UCX offers no authentication: docs/design/relay.md, Trust)")
        return (f"security on: {etcd}CURVE on every ZeroMQ socket, {relay} "
                f"(credentials made in {time.monotonic() - started:.2f} s; --insecure turns it off)")

    def store_credentials(self) -> EtcdCredentials:
        """What this run's processes present to etcd."""
        if self.etcd_tls is not None:
            return self.etcd_tls.client_credentials()
        return self.etcd_creds if self.etcd_arg else EtcdCredentials()

    def daemon_env(self) -> dict[str, str]:
        """Every daemon's credentials, and nothing of the caller's own: a variable left set
        would give the private etcd's clients a user it does not have, or turn CURVE on
        under --insecure."""
        env = dict.fromkeys([*ETCD_ENV.values(), curve.ENV_DIR, JOB_SECRET_ENV], "")
        env.update(self.store_credentials().env())
        if self.credentials is not None:
            env.update(self.credentials.env())
            if not self.relay_auth:
                env[JOB_SECRET_ENV] = ""  # relays on UCX refuse a secret they cannot use
        return env

    def submitted_spec(self) -> dict:
        """The spec as written to etcd: a secure run requires CURVE and the relay secret of
        every daemon, so one started by hand without them is refused, not half-joined."""
        spec = self.spec.to_dict()
        if self.secure:
            spec["security"] = {**spec["security"], "curve": True, "relay_auth": self.relay_auth}
        return spec

    def discard(self, run_dir: Path) -> None:
        """Worthless once the job is gone, and secrets: not left in the run directory."""
        if self.credentials is not None:
            shutil.rmtree(run_dir / "credentials", ignore_errors=True)
            self.credentials = None
