"""How a process proves itself to etcd: TLS (a CA to trust, a client certificate and
key) and etcd's own users (a user and a password file). docs/operations/security.md.

These must be known before the job spec is read (daemons read it from etcd), so they
come from command-line flags and the environment, never from the spec:

    RLFLEET_ETCD_CACERT         CA certificate that signed etcd's server certificate
    RLFLEET_ETCD_CERT           client certificate (etcd --client-cert-auth)
    RLFLEET_ETCD_KEY            its private key (mode 0600)
    RLFLEET_ETCD_USER           etcd user (etcd auth enabled)
    RLFLEET_ETCD_PASSWORD_FILE  that user's password, in a file of mode 0600

`open_store` is the one way every daemon and tool builds its `EtcdStore`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

import grpc

from rlfleet.common.control.store import StoreUnavailable
from rlfleet.common.secret_files import read_private

ENV = {"cacert": "RLFLEET_ETCD_CACERT", "cert": "RLFLEET_ETCD_CERT", "key": "RLFLEET_ETCD_KEY",
       "user": "RLFLEET_ETCD_USER", "password_file": "RLFLEET_ETCD_PASSWORD_FILE"}


class StoreAuthError(StoreUnavailable):
    """etcd answered and refused us: wrong or missing credentials, or no permission.
    A StoreUnavailable, so every caller that waits out an unreachable etcd waits this out
    too (credentials can be fixed without restarting), but its message says which."""


@dataclass(frozen=True)
class EtcdCredentials:
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password_file: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **flags: str | None) -> EtcdCredentials:
        """From flags where given, else the environment; ValueError when incomplete."""
        environ = os.environ if environ is None else environ
        creds = cls(**{name: flags.get(name) or environ.get(var) or None for name, var in ENV.items()})
        creds.check()
        return creds

    def check(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("an etcd client certificate needs its key and the key its certificate "
                             f"(--etcd-cert/${ENV['cert']} with --etcd-key/${ENV['key']})")
        if self.cert and not self.cacert:
            raise ValueError(f"a client certificate is only sent over TLS: give the CA too "
                             f"(--etcd-cacert/${ENV['cacert']})")
        if bool(self.user) != bool(self.password_file):
            raise ValueError("an etcd user needs a password file and a password file a user "
                             f"(--etcd-user/${ENV['user']} with --etcd-password-file/${ENV['password_file']})")
        for name in ("cacert", "cert"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ValueError(f"etcd {name} {path}: no such file")

    @property
    def tls(self) -> bool:
        return bool(self.cacert)

    @property
    def any(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials for gRPC (files read now); None for plain http."""
        if not self.tls:
            return None
        with open(self.cacert, "rb") as f:  # type: ignore[arg-type]
            ca = f.read()
        key = read_private(self.key, "etcd client key file") if self.key else None
        cert = None
        if self.cert:
            with open(self.cert, "rb") as f:
                cert = f.read()
        return grpc.ssl_channel_credentials(ca, key, cert)

    def password(self) -> str | None:
        if not self.password_file:
            return None
        return read_private(self.password_file, "etcd password file").decode().strip()

    def env(self) -> dict[str, str]:
        """The environment that gives a child process these credentials (paths, no secrets)."""
        return {ENV[f.name]: os.path.abspath(v) if f.name != "user" else v
                for f in fields(self) if (v := getattr(self, f.name))}

    def etcdctl_flags(self) -> str:
        """The same credentials as etcdctl flags (for the `etcdctl` equivalents tools print)."""
        flags = [f"--cacert={self.cacert}"] if self.cacert else []
        if self.cert:
            flags += [f"--cert={self.cert}", f"--key={self.key}"]
        if self.user:
            flags += [f"--user={self.user}", "--password=\"$(cat " + str(self.password_file) + ")\""]
        return " ".join(flags)


def open_store(endpoints: str | list[str], timeout_s: float = 1.0, creds: EtcdCredentials | None = None):
    """The `EtcdStore` every daemon and tool uses; ``creds`` default to the environment."""
    from rlfleet.common.control.etcd_store import EtcdStore  # grpc + pyetcd: only when a store is really wanted

    return EtcdStore(endpoints, timeout_s=timeout_s,
                     creds=EtcdCredentials.from_env() if creds is None else creds)


# -- what etcd's refusals and TLS failures mean (used by EtcdStore) -------------------
_REFUSED = {grpc.StatusCode.UNAUTHENTICATED: "not authenticated",
            grpc.StatusCode.PERMISSION_DENIED: "permission denied"}


def raise_if_refused(exc: grpc.RpcError, what: str) -> None:
    """etcd answered "no" to these credentials: StoreAuthError, not "unreachable"."""
    code, details = exc.code(), exc.details() or ""
    auth_words = ("auth", "password", "user", "permission", "token")
    if code in _REFUSED or (code == grpc.StatusCode.INVALID_ARGUMENT and any(w in details for w in auth_words)) \
            or (code == grpc.StatusCode.FAILED_PRECONDITION and "auth" in details):
        raise StoreAuthError(f"etcd {what}: refused: {details or code.name} "
                             "(check --etcd-user/--etcd-password-file or the user's role)") from None


def tls_hint(exc: BaseException | None, tls: bool) -> str:
    """What a failed TLS handshake says, which pyetcd's own error hides (its cause)."""
    while exc is not None and not isinstance(exc, grpc.RpcError):
        exc = exc.__context__
    details = (exc.details() or "") if isinstance(exc, grpc.RpcError) else ""
    lowered = details.lower()
    if any(w in lowered for w in ("ssl", "handshake", "certificate", "tls", "tsi_", "unwrap")):
        return f"; TLS handshake failed: {details} (check --etcd-cacert/--etcd-cert/--etcd-key)"
    if not tls and ("socket closed" in lowered or "connection reset" in lowered):
        return "; does etcd serve TLS? then give --etcd-cacert (and a client certificate)"
    return f"; {details}" if details else ""
