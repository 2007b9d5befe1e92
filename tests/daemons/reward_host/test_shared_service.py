"""The shared reward service (`rlfleet reward-service`, a real subprocess on a real port)
with a rule stage and a simulated accelerator stage: the protocol and its additions,
idempotence by (tenant, trajectory id), per-tenant figures, precise errors for bad
input, auth, and the service spec's validation."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from rlfleet.common.secret_files import write_private
from rlfleet.daemons.tasks import get_task
from rlfleet.tools.run.etcd_local import free_port

from .test_remote import Endpoint

TASK = get_task("arithmetic")
PROMPTS = TASK.make_prompts("train", 32, seed=3)

SERVICE_SPEC = """
[service]
max_body_bytes = 65536
{service}

[pipeline]
queue = "ebf"
scaling = "timeout_aware"
max_extra_delay_s = 0.5
batch_idle_s = 1.0

[[pipeline.stages]]
name = "check"
cost = 1.0
timeout_s = 10
min_workers = 1
max_workers = 2
worker = {{ kind = "rule_pool" }}

[[pipeline.stages]]
name = "judge"
cost = 8.0
timeout_s = 5
min_workers = 1
max_workers = 8
worker = {{ kind = "sim", median_s = {judge_s}, sigma = 0.5 }}
"""


class SharedService:
    """`rlfleet reward-service` as a subprocess; ``url`` is its /score. ``port`` fixed so a
    restart after kill -9 serves the callers' configured URL again."""

    def __init__(self, tmp_path: Path, *, service: str = "", judge_s: float = 0.02,
                 port: int | None = None, tls: str = "") -> None:
        """``tls``: the keys of a [tls] section (the service then serves https://)."""
        self.spec = tmp_path / "service.toml"
        self.spec.write_text(SERVICE_SPEC.format(service=service + (f"\n[tls]\n{tls}" if tls else ""),
                                                 judge_s=judge_s))
        self.log = tmp_path / "service.log"
        self.port = port or free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}/score"
        self.base = self.url.rsplit("/", 1)[0]
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlfleet.tools.cli", "reward-service", "--spec", str(self.spec),
                 "--listen", f"127.0.0.1:{self.port}"],
                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True,
                start_new_session=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line == f"listening on {self.url}\n", (line, self.log.read_text()[-2000:])

    def stats(self, headers: dict[str, str] | None = None, context: Any = None) -> dict[str, Any]:
        req = urllib.request.Request(f"{self.base}/_stats", headers=headers or {})
        with urllib.request.urlopen(req, timeout=10, context=context) as r:
            return json.loads(r.read())

    def metrics(self, headers: dict[str, str] | None = None, context: Any = None) -> str:
        req = urllib.request.Request(f"{self.base}/metrics", headers=headers or {})
        with urllib.request.urlopen(req, timeout=10, context=context) as r:
            return r.read().decode()

    def log_lines(self, event: str) -> list[dict[str, Any]]:
        return [rec for line in self.log.read_text().splitlines() if line.startswith("{")
                for rec in [json.loads(line)] if rec.get("event") == event]

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> str:
        """SIGTERM; the exit line (stderr's last line)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                assert self.proc.wait(20) == 0, self.log.read_text()[-3000:]
            finally:
                if self.proc.poll() is None:
                    self.proc.kill()
                    self.proc.wait(10)
        return self.log.read_text().strip().splitlines()[-1]


def body(i: int, tenant: str = "", right: bool = True, **extra: Any) -> dict[str, Any]:
    p = PROMPTS[i]
    return {"trajectory_id": f"p{i}-g0", "task": "arithmetic", "task_kwargs": {},
            "prompt": p.to_dict(), "completions": [p.answer if right else "x"], "tenant": tenant,
            **extra}


def post(url: str, doc: Any, key: str | None = None, headers: dict[str, str] | None = None,
         raw: bytes | None = None, context: Any = None) -> tuple[int, dict[str, Any]]:
    data = raw if raw is not None else json.dumps(doc).encode()
    if key is None and isinstance(doc, dict):
        key = str(doc.get("trajectory_id", ""))
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Idempotency-Key": key or "", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30, context=context) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def service(tmp_path):
    started: list[SharedService] = []

    def start(**kw: Any) -> SharedService:
        started.append(SharedService(tmp_path, **kw))
        return started[-1]

    yield start
    for s in started:
        s.close()


def test_two_tenants_are_scored_apart_idempotent_by_tenant_and_id(service):
    svc = service(judge_s=0.05)
    # The same trajectory ids in two jobs are two trajectories; a repeated key is one.
    first = {}
    for tenant in ("job-a", "job-b"):
        for i in range(8):
            status, doc = post(svc.url, body(i, tenant, right=i % 2 == 0, batch=i // 4, batch_requests=4))
            assert status == 200, doc
            assert doc["reward"] == TASK.reward(PROMPTS[i], [PROMPTS[i].answer if i % 2 == 0 else "x"])
            assert doc["info"]["tenant"] == tenant
            first[tenant, i] = doc
    # A repeat gets the first answer (its recorded time too: it was not scored again).
    assert post(svc.url, body(3, "job-b", batch=0, batch_requests=4))[1] == first["job-b", 3]
    # Copies in flight together: one scoring, every copy the same answer.
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: post(svc.url, body(20, "job-a", batch=5)), range(6)))
    assert len({json.dumps(a) for a in answers}) == 1 and answers[0][0] == 200
    stats = svc.stats()
    a, b = stats["tenants"]["job-a"], stats["tenants"]["job-b"]
    assert a["requests"]["scored"] == 9 and b["requests"]["scored"] == 8
    assert a["requests"]["repeated"] + a["requests"]["joined"] == 5
    assert b["requests"]["repeated"] == 1
    # Both tenants' batches of 4 closed into the planner's history, and it planned with them.
    assert a["batches"] >= 2 and b["batches"] >= 2
    assert b["plans"] >= 1 and stats["plans"] >= 1
    assert set(stats["stages"]) == {"check", "judge"}
    assert stats["stages"]["check"]["ok"] == stats["stages"]["judge"]["ok"] == 17
    # The metrics page carries the per-tenant and per-stage figures.
    with urllib.request.urlopen(f"{svc.base}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert 'rlfleet_reward_service_requests_total{answer="scored",tenant="job-a"} 9.0' in metrics
    assert 'rlfleet_reward_stage_workers{stage="judge"}' in metrics
    summary = svc.close()
    assert summary.startswith("reward service stopped: job-a:") and "stages: check" in summary


def test_a_stage_error_is_a_422_with_the_stage_named_and_is_the_recorded_answer(service):
    svc = service()
    bad = {**body(1, "t"), "task": "no-such-task"}
    status, doc = post(svc.url, bad)
    assert status == 422 and doc["error"].startswith("stage 'check': ValueError: task: must be one of")
    assert post(svc.url, bad) == (status, doc)
    assert svc.stats()["tenants"]["t"]["requests"] == {"scored": 0, "error": 1, "repeated": 1,
                                                       "joined": 0, "busy": 0}


@pytest.mark.parametrize("doc, key, error", [
    ([1, 2], "k", "body must be a JSON object, got list"),
    ({**body(0), "trajectory_id": 7}, "7", "trajectory_id: expected a string, got 7"),
    (body(0), "other", "the Idempotency-Key header ('other') must equal the body's trajectory_id ('p0-g0')"),
    ({**body(0), "tenant": "a/b"}, None, "tenant: expected 1..128 letters"),
    ({**body(0), "tenant": ["a"]}, None, "tenant: expected a string, got [\"a\"]"),
    ({**body(0), "batch": -1}, None, "batch: expected an integer in 0..9007199254740992, got -1"),
    ({**body(0), "batch": 1.5}, None, "batch: expected an integer"),
    ({**body(0), "batch_requests": True}, None, "batch_requests: expected an integer in 0..1000000, got true"),
    ({**body(0), "task_kwargs": [1]}, None, "task_kwargs: expected an object, got [1]"),
    ({**body(0), "prompt": "37+85"}, None, "prompt: expected an object, got '37+85'"),
    ({**body(0), "prompt": {**PROMPTS[0].to_dict(), "answer": 122}}, None,
     "prompt.answer: expected a string, got 122"),
    ({**body(0), "prompt": {"task": "arithmetic"}}, None, "prompt.split: required"),
    ({**body(0), "completions": "122"}, None, "completions: expected a non-empty list of strings"),
    ({**body(0), "completions": ["1", None]}, None, "completions[1]: expected a string, got null"),
    ({k: v for k, v in body(0).items() if k != "task"}, None, "task: required"),
])
def test_bad_bodies_are_precise_400s(service, doc, key, error):
    svc = service()
    status, answer = post(svc.url, doc, key=key)
    assert status == 400 and answer["error"].startswith(error), answer


def test_hostile_bodies_and_framing_are_refused_and_the_service_keeps_serving(service):
    svc = service()
    assert post(svc.url, None, key="k", raw=b"[" * 60_000) == \
        (400, {"error": "body is not JSON this service reads: nested too deeply"})
    assert post(svc.url, None, key="k", raw=b"\xff\xfe{}")[1]["error"].startswith("body is not UTF-8")
    assert post(svc.url, None, key="k", raw=b'{"trajectory_id": ')[1]["error"].startswith("body is not JSON")
    # A huge body is refused from its Content-Length, unread (the headers are sent alone:
    # a client still sending into the closed connection would see a reset instead).
    for length in (65537, 10**12):
        conn = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=10)
        conn.putrequest("POST", "/score")
        conn.putheader("Content-Length", str(length))
        conn.endheaders()
        r = conn.getresponse()
        assert r.status == 413 and r.getheader("Connection") == "close"
        assert json.loads(r.read()) == {"error": f"body of {length} bytes; at most max_body_bytes=65536"}
        conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=10)
    conn.request("POST", "/score", body=iter([b"{}"]), encode_chunked=True)
    r = conn.getresponse()
    assert r.status == 411 and b"chunked" in r.read()
    conn.close()
    assert post(f"{svc.base}/other", body(0))[0] == 404
    # Still serving.
    assert post(svc.url, body(2, "t"))[0] == 200


def test_auth_token_file(service, tmp_path):
    token = tmp_path / "token"
    write_private(token, b"Bearer s3cret\n")
    svc = service(service=f'auth_secret_file = "{token}"')
    assert post(svc.url, body(0, "t")) == (401, {"error": "wrong or missing Authorization header"})
    assert post(svc.url, body(0, "t"), headers={"Authorization": "Bearer s3cret"})[0] == 200
    with pytest.raises(urllib.error.HTTPError) as exc:
        svc.stats()
    assert exc.value.code == 401
    assert svc.stats({"Authorization": "Bearer s3cret"})["tenants"]["t"]["requests"]["scored"] == 1
    # Counted with the daemons' CURVE refusals; one log line for the address, not one per request.
    assert 'rlfleet_auth_refused_total{reason="token",transport="http"} 2.0' in \
        svc.metrics({"Authorization": "Bearer s3cret"})
    assert len(svc.log_lines("auth_refused")) == 1


def test_answers_journaled_survive_kill_9_and_are_not_scored_again(service, tmp_path):
    journal = tmp_path / "state" / "answers.jsonl"
    svc = service(service=f'answers_journal = "{journal}"')
    first = {i: post(svc.url, body(i, "job-a", right=i % 2 == 0, batch=0, batch_requests=6)) for i in range(6)}
    bad = {**body(9, "job-a"), "task": "no-such-task"}
    first["bad"] = post(svc.url, bad)
    assert [status for status, _ in first.values()] == [200] * 6 + [422]
    svc.kill9()
    svc.start()  # same port, same journal
    for i in range(6):
        assert post(svc.url, body(i, "job-a", right=i % 2 == 0, batch=0, batch_requests=6)) == first[i]
    assert post(svc.url, bad) == first["bad"]
    assert post(svc.url, body(7, "job-a", batch=1, batch_requests=1))[0] == 200  # a new one is scored
    stats = svc.stats()
    assert stats["tenants"]["job-a"]["requests"] == {"scored": 1, "error": 0, "repeated": 7,
                                                     "joined": 0, "busy": 0}
    assert stats["stages"]["check"]["ok"] == 1 and stats["answers_kept"] == 8
    # A second service on the same journal is refused before it listens.
    other = subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "reward-service", "--spec",
                            str(svc.spec), "--listen", "127.0.0.1:0"], capture_output=True, text=True, timeout=60)
    assert other.returncode == 1 and other.stdout == ""
    assert other.stderr.strip().endswith(f"answers_journal {journal}: in use by another reward service")


def test_one_tenants_burst_cannot_take_every_slot(service):
    svc = service(service="max_pending_per_tenant = 2", judge_s=1.0)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        held = [pool.submit(post, svc.url, body(i, "job-a", batch=0, batch_requests=3)) for i in range(2)]
        deadline = time.monotonic() + 20
        while svc.stats().get("pending") != 2:
            assert time.monotonic() < deadline, svc.stats()
            time.sleep(0.05)
        assert post(svc.url, body(2, "job-a", batch=0, batch_requests=3)) == (503, {
            "error": "busy: tenant 'job-a' has 2 trajectories pending (max_pending_per_tenant); retry"})
        assert post(svc.url, body(2, "job-b", batch=0, batch_requests=1))[0] == 200  # another job still is
        assert [f.result()[0] for f in held] == [200, 200]
    assert post(svc.url, body(2, "job-a", batch=0, batch_requests=3))[0] == 200  # its slots are free again
    assert svc.stats()["tenants"]["job-a"]["requests"]["busy"] == 1


def test_a_taken_port_is_refused_with_the_reason(service):
    svc = service()
    taken = subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "reward-service", "--spec",
                            str(svc.spec), "--listen", f"127.0.0.1:{svc.port}"],
                           capture_output=True, text=True, timeout=60)
    assert taken.returncode == 1 and taken.stdout == ""
    assert taken.stderr.strip().splitlines()[-1] == f"--listen 127.0.0.1:{svc.port}: Address already in use"


def test_the_reference_endpoint_accepts_the_new_fields():
    endpoint = Endpoint()
    try:
        status, doc = post(endpoint.url, body(4, "job-a", batch=2, batch_requests=16))
        assert status == 200 and doc["reward"] == 1.0
    finally:
        endpoint.close()


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "reward-service", *args],
                          capture_output=True, text=True, timeout=60)


def test_the_spec_is_checked_like_a_job_spec(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text(SERVICE_SPEC.format(service="", judge_s=0.1))
    result = cli("--spec", str(good), "--check")
    assert result.returncode == 0
    assert result.stdout == f"{good}: ok (2 stages: check, judge; queue ebf, scaling timeout_aware)\n"
    bad = tmp_path / "bad.toml"
    bad.write_text("""
[servic]
[service]
max_pending = 0
auth_secret_file = "token"
answers_journal = "answers.jsonl"
[pipeline]
queue = "lifo"
[[pipeline.stages]]
name = "check"
min_workers = 3
max_workers = 2
worker = { kind = "rule_pool", timeout_s = 3 }
[[pipeline.stages]]
name = "judge"
worker = { kind = "pipeline" }
""")
    result = cli("--spec", str(bad), "--listen", "127.0.0.1:0")  # refused before it listens
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"{bad}: servic: unknown section (did you mean 'service'?)",
        f"{bad}: service.auth_secret_file: must be an absolute path, got 'token'",
        f"{bad}: service.max_pending: must be > 0, got 0",
        f"{bad}: service.answers_journal: must be an absolute path, got 'answers.jsonl'",
        f"{bad}: pipeline.stages[0].worker: timeout_s: set on the stage (timeout_s, min_workers, "
        "max_workers), which passes it down to its worker",
        f"{bad}: pipeline.stages[1].worker: kind 'pipeline' cannot serve a stage (a stage is one worker kind)",
        f"{bad}: pipeline.queue: must be one of 'ebf', 'fcfs', got 'lifo'",
    ]
    assert cli("--spec", str(good), "--listen", "nohost").returncode == 2
    missing = cli("--spec", str(tmp_path / "none.toml"), "--check")
    assert missing.returncode == 2 and "none.toml: cannot read" in missing.stderr


def test_the_shipped_example_loads():
    from rlfleet.common.spec.job import load_spec
    from rlfleet.daemons.reward_host.shared.spec import load_service_spec

    folder = Path(__file__).resolve().parents[3] / "examples" / "shared-reward"
    service = load_service_spec(folder / "service.toml")
    assert [s.name for s in service.pipeline.stages] == ["check", "judge"]
    for name in ("a", "b"):
        spec = load_spec(folder / f"job-{name}.toml")
        assert spec.job.name == f"shared-{name}"
        assert spec.reward_host.backend.endpoints == ("http://127.0.0.1:8800/score",)
