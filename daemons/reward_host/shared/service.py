"""The shared reward service: several jobs' reward-hosts score on ONE pipeline, so its
stage queues order all their batches (EBF across tenants) and one planner sizes the
stages for all of them (DistRS Algorithm 2 over every tenant's open batches).

    job A's reward-host ─┐  POST /score (remote_http)
                         ├──► HTTP handlers ──► Scorer thread: PipelineBackend ──► answers
    job B's reward-host ─┘     (one thread each)    (stages, queues, planner)

``rlfleet reward-service --spec SERVICE.toml --listen HOST:PORT`` (tools/ctl/reward_service.py;
spec: shared_spec.py; docs/design/reward.md "Shared reward service"). Each job keeps its own
reward-host with ``[reward_host.backend] kind = "remote_http"`` pointing here: dedup,
acks and delivery to its trainer stay per job, and the service is a remote endpoint
that speaks the same protocol plus ``tenant``, ``batch`` and ``batch_requests``
(shared_protocol.py).

Threads: the HTTP server's, one per connection, which read and check a request and wait
for its answer; ``reward-scorer``, which alone touches the PipelineBackend (it is
single-threaded by design) and the answers, taking requests from an inbox announced on
a pipe that it selects on with the backend's fds; and the backend's own
``reward-planner`` (planner_thread.py), which computes the scaling plans from snapshots
the scorer hands it, so a plan (up to ~1.5 s) never holds up scoring.

Idempotent by (tenant, trajectory id): a key answered gets the same answer (200 with the
reward, or 422 with the stage's error) without running again; a copy that arrives while
the first is in the pipeline waits for that one. The record keeps ``results_kept``
answers. With ``answers_journal`` set it is also on disk (answer_journal.py), written
before any caller sees the answer, so a restarted service answers those keys from it. A
kill still loses the queues, the running requests and the planner's history: the
callers' retries score those trajectories on the restarted service (without the journal,
the answered ones too; each reward-host forwards one outcome per trajectory either way).

Transport: with the spec's ``[tls]`` every connection is HTTPS (TLS 1.2+, the
certificate issued by the job's CA; with ``client_ca_file``, a client certificate too).
The handshake runs in the connection's own thread under the handler's socket timeout, so
a client that stalls it holds only that thread; a refused handshake (a plain-HTTP client,
an unknown client certificate) is logged once per address. Without ``[tls]``, plain HTTP
on a loopback address only (shared_spec.listen_refusal), with a warning.
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import json
import logging
import os
import select
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

from rlfleet.common.wire.curve import REFUSED
from rlfleet.daemons.reward_host.pipeline.backend import PipelineBackend
from rlfleet.daemons.reward_host.remote.config import read_secret
from rlfleet.daemons.reward_host.shared.answer_journal import AnswerJournal
from rlfleet.daemons.reward_host.shared.protocol import BadRequest, ScoreRequest, read_request, split_key
from rlfleet.daemons.reward_host.shared.spec import ServiceSpec, listen_refusal

log = logging.getLogger("rlfleet.reward_service")

REQUESTS = Counter("rlfleet_reward_service_requests_total",
                   "Score requests by tenant and answer: scored, error (422), repeated (answered "
                   "from the record), joined (waited for a copy in the pipeline), busy (503)",
                   ["tenant", "answer"])

_ANSWERS = ("scored", "error", "repeated", "joined", "busy")


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int
    body: bytes


@dataclasses.dataclass
class _Pending:
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    answer: Answer | None = None


class Scorer:
    """The pipeline behind the HTTP handlers (see the module docstring)."""

    def __init__(self, spec: ServiceSpec) -> None:
        self.spec = spec
        self.journal = AnswerJournal(spec.service.answers_journal, spec.service.results_kept) \
            if spec.service.answers_journal else None
        self.backend = PipelineBackend(spec.pipeline)
        self._lock = threading.Lock()
        self._inbox: collections.deque[ScoreRequest] = collections.deque()
        self._pending: dict[tuple[str, str], _Pending] = {}
        self._pending_by_tenant: dict[str, int] = {}
        self._answers: collections.OrderedDict[tuple[str, str], Answer] = collections.OrderedDict(
            (ident, Answer(*entry)) for ident, entry in (self.journal.loaded.items() if self.journal else ()))
        self._counts: dict[str, dict[str, int]] = {}
        self._expect: dict[str, int] = {}  # tenant -> batch_requests told to the pipeline
        self._snapshot: dict[str, Any] = {}
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reward-scorer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the handlers' side ----------------------------------------------------------------
    def score(self, request: ScoreRequest) -> Answer:
        ident = request.ident
        with self._lock:
            answer = self._answers.get(ident)
            if answer is not None:
                self._count(request.tenant, "repeated")
                return answer
            pending = self._pending.get(ident)
            if pending is not None:
                self._count(request.tenant, "joined")
            elif why := self._full(request.tenant):
                self._count(request.tenant, "busy")
                return _error(503, f"busy: {why}; retry")
            else:
                pending = self._pending[ident] = _Pending()
                self._pending_by_tenant[request.tenant] = self._pending_by_tenant.get(request.tenant, 0) + 1
                self._inbox.append(request)
                _wake(self._wfd)
        if not pending.done.wait(self.spec.service.answer_within_s) or pending.answer is None:
            return _error(503, f"not answered within answer_within_s="
                               f"{self.spec.service.answer_within_s:g}; retry: the same key gets its answer")
        return pending.answer

    def _full(self, tenant: str) -> str:  # under self._lock
        """Why a new trajectory of ``tenant`` cannot be taken now, or ""."""
        service = self.spec.service
        if self._stop.is_set():
            return "shutting down"
        if len(self._pending) >= service.max_pending:
            return f"{len(self._pending)} trajectories pending (max_pending)"
        mine = self._pending_by_tenant.get(tenant, 0)
        if service.max_pending_per_tenant is not None and mine >= service.max_pending_per_tenant:
            return f"tenant {tenant!r} has {mine} trajectories pending (max_pending_per_tenant)"
        return ""

    def stats(self) -> dict[str, Any]:
        """The scorer thread's last snapshot of the pipeline, with the request counts
        (kept by the handlers) as they are now."""
        with self._lock:
            stats = json.loads(json.dumps(self._snapshot))  # a copy the caller may keep
            stats.setdefault("tenants", {})
            for tenant, counts in self._counts.items():
                stats["tenants"].setdefault(tenant, _tenant_figures(None))["requests"] = dict(counts)
            return stats

    def close(self) -> None:
        """Stop the loop; waiting requests get 503 (their callers retry elsewhere or later)."""
        self._stop.set()
        _wake(self._wfd)
        if self._thread.ident is not None:  # not started when the port could not be bound
            self._thread.join(10)
        with self._lock:
            for pending in self._pending.values():
                pending.answer = _error(503, "the reward service is stopping; retry")
                pending.done.set()
        self.backend.close()
        if self.journal is not None:
            self.journal.close()

    # -- the scorer thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._step()
        except Exception:
            log.exception("reward service: the scorer thread failed")
            raise

    def _step(self) -> None:
        wait = min(self.backend.next_deadline_in(), 0.5)
        select.select([self._rfd, *self.backend.fds()], [], [], wait)
        with self._lock:
            _drain(self._rfd)
            requests, self._inbox = self._inbox, collections.deque()
        for request in requests:
            if self._expect.get(request.tenant) != request.batch_requests:
                self._expect[request.tenant] = request.batch_requests
                self.backend.expect(request.tenant, request.batch_requests)
            self.backend.submit(request.job)
        answered = []
        for outcome in self.backend.poll(0.0):
            ident = split_key(outcome.key)
            if outcome.error:
                answered.append((ident, _error(422, outcome.error)))
            else:
                answered.append((ident, Answer(200, json.dumps({"reward": outcome.reward, "info": {
                    "tenant": ident[0], "seconds": round(outcome.seconds, 4)}}).encode())))
        if self.journal is not None:  # on disk before any caller sees it
            self.journal.append([(ident, (a.status, a.body)) for ident, a in answered])
        snapshot = self._figures()
        with self._lock:
            for ident, answer in answered:
                self._count(ident[0], "error" if answer.status != 200 else "scored")
                self._answers[ident] = answer
                while len(self._answers) > self.spec.service.results_kept:
                    self._answers.popitem(last=False)
                pending = self._pending.pop(ident, None)
                if pending is not None:
                    self._pending_by_tenant[ident[0]] -= 1
                if pending is not None:
                    pending.answer = answer
                    pending.done.set()
            snapshot["pending"] = len(self._pending)
            snapshot["answers_kept"] = len(self._answers)
            self._snapshot = snapshot
        # Outside the lock: only this thread changes the record, the handlers only read it.
        if self.journal is not None and self.journal.needs_rewrite:
            self.journal.rewrite((ident, (a.status, a.body)) for ident, a in self._answers.items())

    def _figures(self) -> dict[str, Any]:
        b = self.backend
        return {"stages": b.status(), "plans": b.planner.plans, "batches_done": b.batches_done,
                "open_batches": len(b.batches),
                "tenants": {t: _tenant_figures(f) for t, f in b.tenants.items()}}

    def _count(self, tenant: str, answer: str) -> None:  # under self._lock
        counts = self._counts.setdefault(tenant, dict.fromkeys(_ANSWERS, 0))
        counts[answer] += 1
        REQUESTS.labels(tenant=tenant, answer=answer).inc()


def _tenant_figures(f: Any) -> dict[str, Any]:
    if f is None:
        return {"batches": 0, "extra_delay_mean_s": 0.0, "extra_delay_max_s": 0.0, "plans": 0}
    return {"batches": f.batches, "plans": f.plans, "extra_delay_max_s": round(f.extra_delay_max_s, 4),
            "extra_delay_mean_s": round(f.extra_delay_sum_s / f.batches, 4) if f.batches else 0.0}


def _error(status: int, message: str) -> Answer:
    return Answer(status, json.dumps({"error": message}).encode())


def _wake(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except BlockingIOError:
        pass  # the pipe is full: the loop is woken already


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


# ----------------------------------------------------------------------------- HTTP
class Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"  # keep-alive: the callers' pools hold their connections
    timeout = 30  # socket timeout: a caller that stops sending mid-body frees its thread

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 — the base's name
        pass  # one line per request would swamp the log; the metrics count them

    def _answer(self, answer: Answer, content_type: str = "application/json") -> None:
        self.send_response(answer.status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(answer.body)))
        if answer.status == 503:
            self.send_header("Retry-After", "1")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(answer.body)

    def _authorized(self) -> bool:
        token = self.server.auth
        if token is None:
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), token.encode()):
            return True
        self.close_connection = True  # the body is not read: the connection cannot go on
        self.server.refuse(self.client_address[0], "token", "wrong or missing Authorization header")
        self._answer(_error(401, "wrong or missing Authorization header"))
        return False

    def do_GET(self) -> None:  # noqa: N802 — http.server's name
        if not self._authorized():
            return
        if self.path == "/_stats":
            self._answer(Answer(200, json.dumps(self.server.scorer.stats()).encode()))
        elif self.path == "/metrics":
            self._answer(Answer(200, generate_latest()), CONTENT_TYPE_LATEST)
        else:
            self._answer(_error(404, f"no route GET {self.path[:100]}"))

    def do_POST(self) -> None:  # noqa: N802
        if not self._authorized():
            return
        try:
            raw = self._body()
            if self.path != "/score":
                raise BadRequest(f"no route POST {self.path[:100]} (scoring is POST /score)", 404)
            request = read_request(raw, self.headers.get("Idempotency-Key"))
        except BadRequest as exc:
            self._answer(_error(exc.status, exc.message))
            return
        self._answer(self.server.scorer.score(request))

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise BadRequest("Content-Length required (a chunked body is not accepted)", 411)
        length = self.headers.get("Content-Length")
        try:
            n = int(length or "")
        except ValueError:
            self.close_connection = True
            raise BadRequest(f"Content-Length required: a byte count, got {length!r}", 411) from None
        limit = self.server.scorer.spec.service.max_body_bytes
        if n < 0:
            self.close_connection = True
            raise BadRequest(f"Content-Length must be >= 0, got {n}")
        if n > limit:
            self.close_connection = True  # unread: the rest of the stream is not a request
            raise BadRequest(f"body of {n} bytes; at most max_body_bytes={limit}", 413)
        raw = self.rfile.read(n)
        if len(raw) != n:
            self.close_connection = True
            raise BadRequest(f"body ended after {len(raw)} of {n} bytes")
        return raw


class Server(ThreadingHTTPServer):
    daemon_threads = True  # a waiting request must not keep a stopping process alive
    request_queue_size = 128
    _MAX_REMEMBERED = 1000  # (address, reason) refusals logged; past that, only counted

    def __init__(self, address: tuple[str, int], scorer: Scorer, auth: str | None,
                 tls: ssl.SSLContext | None = None) -> None:
        super().__init__(address, Handler)
        self.scorer, self.auth, self.tls = scorer, auth, tls
        self._refused: set[tuple[str, str]] = set()

    def finish_request(self, request: Any, client_address: Any) -> None:
        """In the connection's thread: the TLS handshake (when serving HTTPS), then the
        handler. Not in accept()'s thread, where one slow client would stop the others."""
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(Handler.timeout)
        try:
            conn = self.tls.wrap_socket(request, server_side=True)  # closes itself if refused
        except (ssl.SSLError, OSError) as exc:
            reason = getattr(exc, "reason", None) or type(exc).__name__
            self.refuse(client_address[0], "tls_handshake", f"TLS handshake failed ({reason})")
            return
        try:
            super().finish_request(conn, client_address)
        finally:
            self.shutdown_request(conn)  # the plain socket was handed over (detached) to conn

    def refuse(self, peer: str, reason: str, why: str) -> None:
        """Counted with the daemons' CURVE refusals (``rlfleet_auth_refused_total``, one
        metric for every authentication a job refuses); logged once per address and reason."""
        REFUSED.labels("https" if self.tls is not None else "http", reason).inc()
        if (peer, reason) in self._refused or len(self._refused) >= self._MAX_REMEMBERED:
            return
        self._refused.add((peer, reason))  # one line per address: a scanner cannot flood the log
        log.warning("refused a connection from %s: %s", peer, why,
                    extra={"event": "auth_refused", "reason": reason})


def serve(spec: ServiceSpec, host: str, port: int, stop: threading.Event,
          on_listening: Any = None) -> str:
    """Run the service until ``stop`` is set; ``on_listening(url)`` once it accepts.
    Returns the exit line: what was scored, per tenant, and the pipeline's summary."""
    if why := listen_refusal(spec, host):
        raise ValueError(why)
    auth = read_secret(spec.service.auth_secret_file) if spec.service.auth_secret_file else None
    tls = spec.tls.context() if spec.tls is not None else None  # TlsFileError: a ValueError
    if tls is None:
        log.warning("serving plain HTTP on %s (loopback only): give the spec [tls] to serve HTTPS", host)
    scorer = Scorer(spec)
    try:
        server = Server((host, port), scorer, auth, tls)
    except BaseException:
        scorer.close()
        raise
    scorer.start()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                              name="reward-http", daemon=True)
    thread.start()
    bound_host, bound_port = server.server_address[:2]
    if on_listening is not None:
        on_listening(f"{'https' if tls else 'http'}://{bound_host}:{bound_port}/score")
    try:
        while not stop.wait(1.0):
            if not scorer.alive():
                raise RuntimeError("the scorer thread died (logged above); stopping")
    finally:
        server.shutdown()
        server.server_close()
        scorer.close()
    tenants = scorer.stats().get("tenants", {})
    per_tenant = "; ".join(f"{t or '(none)'}: {f.get('requests', {})}, {f['batches']} batches"
                           for t, f in sorted(tenants.items()))
    return f"{per_tenant}; {scorer.backend.summary()}"
