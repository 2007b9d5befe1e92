"""A whole `rlfleet run` with its default security (TLS etcd with client certificates,
CURVE on every ZeroMQ socket, the relay's job secret), real processes throughout.

While it trains, the test plays an attacker on the same machine: it injects a
ScoredTrajectory into the trainer's published socket, once with no CURVE and once with
a CURVE key of its own (knowing the trainer's public key, which etcd shows). Without
security such a message was accepted, journaled and counted; here both are refused,
the trainer logs each refusal, and nothing of them reaches the journal.

Then it plays a compromised daemon: with each role's own key pair (from the run's
credentials), one `rlfleet curve-probe` process tries every server socket of the running
daemons (trainer, reward-host, rollout) at once. Exactly the edges of common/wire/edges.py
are admitted; the reward-host's key, which the trainer admits, injects a trajectory of a
prompt nobody claimed, and it is refused with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rlfleet.common.control.etcd_auth import EtcdCredentials, open_store
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.store import StoreUnavailable
from rlfleet.common.spec.placement import ROLES
from rlfleet.common.wire import curve
from rlfleet.common.wire.edges import EDGES
from rlfleet.common.wire.reliable import ReliableSender
from rlfleet.common.wire.sockets import CurveKeys
from rlfleet.daemons.trainer.journal import ExperienceJournal
from rlfleet.tools.exit_codes import Exit
from tests.daemons.trainer.conftest import scored
from tests.integration.helpers import REPO, TINY_MODEL, small_job, wait_for, write_spec

needs_model = pytest.mark.skipif(not (TINY_MODEL / "tokenizer.json").exists(), reason="models/tiny-qwen2 not built")

JOB = small_job(eval_every_steps=100, max_steps=6)

# The injection test's run trains until the test stops it: its 6 steps take well under a
# second on an idle machine, and the refusals must land while the trainer still serves.
JOB_UNTIL_STOPPED = JOB.replace("max_steps = 6", "max_steps = 1000000")
INJECTED = 987654  # a prompt id no claim ever hands out


def _clean_env() -> dict[str, str]:
    drop = ("RLFLEET_ETCD", "RLFLEET_CURVE_DIR", "RLFLEET_JOB_SECRET_FILE")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


class Lines:
    """stdout of a process, read by a thread, so the pipe never fills."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()

    def find(self, marker: str) -> str | None:
        return next((line for line in list(self.lines) if marker in line), None)


@needs_model
def test_a_secure_run_trains_and_refuses_injected_trajectories(tmp_path):
    spec = write_spec(tmp_path, job="secure", extra=JOB_UNTIL_STOPPED)
    proc = subprocess.Popen([sys.executable, "-m", "rlfleet.tools.cli", "run", str(spec), "--no-view"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=_clean_env())
    out = Lines(proc)
    try:
        run_dir = Path(wait_for("the run dir line", lambda: out.find("run dir: "), 60).split("run dir: ")[1].strip())
        started = wait_for("the job line", lambda: out.find("job secure:"), 60)
        assert out.find("security on: etcd over TLS with client certificates, CURVE"), out.lines
        endpoints = started.split(" etcd ")[1].split(",")[0]
        pki = run_dir / "credentials" / "etcd"
        creds = EtcdCredentials(cacert=str(pki / "ca.crt"), cert=str(pki / "client.crt"), key=str(pki / "client.key"))

        stranger_store = open_store(endpoints, creds=EtcdCredentials())
        with pytest.raises(StoreUnavailable):  # the private etcd: no certificate, no answer
            stranger_store.get(JobKeys("secure").spec)
        stranger_store.close()

        store = open_store(endpoints, creds=creds)
        try:
            assert store.get(JobKeys("secure").spec).value["security"]["curve"] is True
            address = wait_for("the trainer's trajectories address", lambda: next(
                (m.value.get("addresses", {}).get("trajectories")
                 for m in store.get_prefix(JobKeys("secure").role_members_prefix("trainer"))
                 if m.value.get("addresses", {}).get("trajectories")), None), 120)
        finally:
            store.close()
        plain_address, server_key = curve.split(address)
        assert server_key is not None, address  # the registration carries the server's key

        injected = [scored(INJECTED, k, 1.0) for k in range(4)]
        with ReliableSender(address, curve=CurveKeys.generate(server_public=server_key), name="stranger") as keyed, \
                ReliableSender(plain_address, name="plain") as plain:
            for sender in (keyed, plain):
                for st in injected:
                    sender.send(st.trajectory.trajectory_id, st)
            assert not keyed.flush(3.0) and not plain.flush(3.0)  # no ack: nothing was accepted
        trainer_log = run_dir / "logs" / "trainer-0.log"
        # The client without CURVE fails its handshake: as a mechanism mismatch ("does not speak
        # CURVE"), or, when it drops the connection first, with the errno of that (EPIPE).
        wait_for("the trainer to log both refusals", lambda: "is not authorized" in (text := trainer_log.read_text())
                 and ("does not speak CURVE" in text or "the connection ended during the handshake" in text), 60)
        wait_for("a progress line (steps trained)", lambda: out.find(" reward "), 120)
        _every_role_against_every_socket(run_dir, endpoints, creds)
    finally:
        if proc.poll() is None:
            proc.terminate()
        code = proc.wait(60)
    assert code == Exit.STOPPED, "".join(out.lines[-40:])
    with ExperienceJournal(run_dir / "checkpoints" / "journal.bin", fsync=False) as journal:
        state = journal.state
        groups = {*state.pending, *state.trained, *state.dropped}
    assert f"p{INJECTED}" not in groups and state.trained, sorted(groups)[:10]
    assert "accounting" in "".join(out.lines) and "invariant holds" in "".join(out.lines)
    assert not (run_dir / "credentials").exists()  # secrets do not outlive the run


SOCKETS = {"trainer-trajectories": ("trainer", "trajectories"),
           "reward-host-trajectories": ("reward-host", "trajectories"),
           "rollout-requests": ("rollout", "requests")}


def _every_role_against_every_socket(run_dir: Path, endpoints: str, creds: EtcdCredentials) -> None:
    keys_dir = run_dir / "credentials" / "curve"
    store = open_store(endpoints, creds=creds)
    try:
        addresses = {edge: wait_for(f"the {role}'s {name} address", lambda role=role, name=name: next(
            (m.value["addresses"][name] for m in store.get_prefix(JobKeys("secure").role_members_prefix(role))
             if m.value.get("addresses", {}).get(name)), None), 60) for edge, (role, name) in SOCKETS.items()}
    finally:
        store.close()
    assert set(addresses) == set(EDGES)
    # One process probes every pair at once, each with that role's own pair from the run's keys.
    probed = subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "curve-probe", str(keys_dir),
                             *addresses.values(), "--json", "--timeout", "20"],
                            capture_output=True, text=True, timeout=60, cwd=REPO, env=_clean_env())
    assert probed.returncode == 0, probed.stderr[-2000:]
    seen = json.loads(probed.stdout)
    expected = {address: {role: "admitted" if role in EDGES[edge] else "refused (auth)" for role in ROLES}
                for edge, address in addresses.items()}
    assert seen == expected
    logs = {edge: run_dir / "logs" / f"{role}-0.log" for edge, (role, _) in SOCKETS.items()}
    env_key = curve.CurveSetup.load(keys_dir, "env-host").public.decode()
    wait_for("the trainer to name the env-host's key and role", lambda: f"key {env_key} speaks for env-host; "
             "trainer-trajectories admits reward-host" in logs["trainer-trajectories"].read_text(), 30)

    # The trainer admits the reward-host's key; what it sends is still checked.
    pair = curve.CurveSetup.load(keys_dir, "reward-host")
    keys = CurveKeys(pair.public, pair.secret, server_public=curve.split(addresses["trainer-trajectories"])[1])
    squat = scored(INJECTED, 0, 1.0)
    with ReliableSender(addresses["trainer-trajectories"], curve=keys, name="compromised-reward-host") as sender:
        sender.send(squat.trajectory.trajectory_id, squat)
        assert sender.flush(30.0)
        assert len(sender.failed) == 1 and sender.failed[0][1].startswith(
            f"identity: prompt {INJECTED} was never claimed"), sender.failed


def test_a_daemon_without_the_keys_the_job_requires_refuses_to_start(tmp_path, etcd):
    spec = write_spec(tmp_path, job="needskeys", extra="\n[security]\ncurve = true\n")
    done = subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "daemon", "repack-manager", "--job", "needskeys",
                           "--etcd", etcd.endpoints_arg, "--spec", str(spec)],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=_clean_env())
    assert done.returncode == 2, done.stderr[-2000:]
    assert "refusing to start: the job requires CURVE" in done.stderr
    store = open_store(etcd.endpoints_arg, creds=EtcdCredentials())
    try:  # it never registered
        assert store.get_prefix(JobKeys("needskeys").role_members_prefix("repack-manager")) == []
    finally:
        store.close()


@needs_model
def test_a_whole_run_on_an_etcd_with_tls_client_certificates_and_users(tmp_path):
    """A cluster-style etcd: TLS with --client-cert-auth and etcd users (auth enable), the
    job's user limited to /rlfleet/ — `rlfleet run --etcd` with every credential flag
    trains to the end with CURVE and the relay secret on; a user without a password file
    is a usage error, and with a wrong password etcd refuses and the refusal is said."""
    from rlfleet.common.secret_files import write_private
    from rlfleet.tools.run.credentials import make_etcd_tls
    from rlfleet.tools.run.etcd_local import EtcdCluster

    from .test_etcd_auth import _etcdctl

    tls = make_etcd_tls(tmp_path / "pki")
    cluster = EtcdCluster(1, base_dir=tmp_path / "etcd", tls=tls).start()
    try:
        cert = ["--cacert", str(tls.ca), "--cert", str(tls.client_cert), "--key", str(tls.client_key)]
        for args in (["user", "add", "root", "--new-user-password=root-pw"],
                     ["user", "add", "fleet", "--new-user-password=fleet-pw"], ["role", "add", "fleet"],
                     ["role", "grant-permission", "fleet", "--prefix=true", "readwrite", "/rlfleet/"],
                     ["user", "grant-role", "fleet", "fleet"], ["auth", "enable"]):
            _etcdctl(cluster, *cert, *args)
        password = tmp_path / "fleet.pw"
        write_private(password, b"fleet-pw\n")
        flags = ["--etcd", cluster.endpoints_arg, "--etcd-cacert", str(tls.ca), "--etcd-cert", str(tls.client_cert),
                 "--etcd-key", str(tls.client_key), "--etcd-user", "fleet"]
        spec = write_spec(tmp_path, job="authed", extra=JOB)

        def run(*more: str, timeout: float = 120) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "run", str(spec), "--no-view", *flags,
                                   *more], capture_output=True, text=True, cwd=REPO, env=_clean_env(), timeout=timeout)

        no_password = run()
        assert no_password.returncode == 2 and "--etcd-password-file" in no_password.stderr, no_password.stderr
        wrong = tmp_path / "wrong.pw"
        write_private(wrong, b"not-the-password\n")
        refused = run("--etcd-password-file", str(wrong))
        said = refused.stdout + refused.stderr
        assert refused.returncode != 0 and "refused" in said, said[-2000:]

        done = run("--etcd-password-file", str(password), timeout=400)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        assert "security on: CURVE on every ZeroMQ socket, relay authenticated" in done.stdout, done.stdout[-2000:]
        assert "trainer finished 6 steps" in done.stdout and "invariant holds" in done.stdout, done.stdout[-2000:]
    finally:
        cluster.stop()
