"""A reference reward endpoint for the ``remote_http`` backend: scores with a task's rule
reward over HTTP, and injects latency, errors and hangs on demand (tests, demos).

    python -m rlfleet.tools.reward_endpoint --port 8000 [--latency-s 0.05]
        [--error-rate 0.1] [--hang-rate 0.01] [--auth-file /etc/rlfleet/reward-token]

prints ``listening on http://HOST:PORT/score`` once it accepts requests. The protocol is
the backend's (daemons/reward_host/remote/backend.py, docs/design/reward.md "Remote endpoints"):

    POST /score   {"trajectory_id", "task", "task_kwargs", "prompt", "completions"}
                  (a shared reward service's "tenant", "batch", "batch_requests": ignored)
                  header Idempotency-Key: <trajectory id>
        200 {"reward": r, "info": {"scored_by": pid, "cached": bool}}
        400 a body that is not the protocol, 401 a wrong auth header,
        422 the task's reward raised (never retried), 503 (or --error-status) injected

A repeated Idempotency-Key gets the first answer again without scoring; a copy that
arrives while the first is being scored waits for it. Faults come before scoring, so a
hung or failed request scores nothing
and does not hold its key. For tests, two more routes:

    GET  /_stats    requests, in_flight, max_in_flight, errors, hangs, and per key the
                    requests (asked) and the scorings (idempotence: never above 1)
    POST /_control  {"latency_s", "error_rate", "error_status", "hang_rate",
                     "fail_next": n, "hang_next": n} — any subset; fail_next/hang_next make
                    the next n scoring requests fail/hang (deterministic faults)

Threads: one per connection (http.server.ThreadingHTTPServer); state under one lock.
Standard library only: the endpoint is a stand-in for someone else's service.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rlfleet.common.wire.messages import Prompt
from rlfleet.daemons.tasks import get_task
from rlfleet.tools.options import add_options

_KNOBS = {"latency_s": float, "error_rate": float, "error_status": int, "hang_rate": float,
          "fail_next": int, "hang_next": int}


class EndpointState:
    def __init__(self, *, latency_s: float = 0.0, error_rate: float = 0.0, error_status: int = 503,
                 hang_rate: float = 0.0, seed: int = 0, auth: str | None = None) -> None:
        self.lock = threading.Lock()
        self.knobs: dict[str, Any] = {"latency_s": latency_s, "error_rate": error_rate,
                                      "error_status": error_status, "hang_rate": hang_rate,
                                      "fail_next": 0, "hang_next": 0}
        self.auth = auth
        self.rng = random.Random(seed)
        self.results: dict[str, bytes] = {}  # idempotency key -> the 200 body given
        self.scoring: dict[str, threading.Event] = {}  # key -> set when its first copy is done
        self.scorings: dict[str, int] = {}  # key -> times scored (idempotence: at most 1)
        self.asked: dict[str, int] = {}  # key -> requests that reached scoring (faults included)
        self.tasks: dict[str, Any] = {}
        self.counts = {"requests": 0, "in_flight": 0, "max_in_flight": 0, "errors": 0, "hangs": 0}
        self.stop = threading.Event()

    def control(self, changes: dict[str, Any]) -> None:
        for name, value in changes.items():
            kind = _KNOBS.get(name)
            if kind is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"unknown knob or not a number: {name}={value!r}")
            with self.lock:
                self.knobs[name] = kind(value)

    def fault(self) -> str:
        """'hang', 'error' or '' for a request about to be scored."""
        with self.lock:
            k = self.knobs
            if k["hang_next"] > 0:
                k["hang_next"] -= 1
                return "hang"
            if k["fail_next"] > 0:
                k["fail_next"] -= 1
                return "error"
            if self.rng.random() < k["hang_rate"]:
                return "hang"
            if self.rng.random() < k["error_rate"]:
                return "error"
        return ""

    def score(self, doc: dict[str, Any]) -> float:
        name, kwargs = doc["task"], doc.get("task_kwargs") or {}
        cache_key = f"{name}:{sorted(kwargs.items())}"
        with self.lock:
            task = self.tasks.get(cache_key)
        if task is None:
            task = get_task(name, **kwargs)
            with self.lock:
                self.tasks[cache_key] = task
        reward = float(task.reward(Prompt.from_dict(doc["prompt"]), list(doc["completions"])))
        if not math.isfinite(reward):
            raise ValueError(f"reward is {reward}")
        return reward


class Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"  # keep-alive, as a real endpoint behind a load balancer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 — the base's name
        pass  # one line per request would swamp a test's output

    def _answer(self, status: int, doc: dict[str, Any] | bytes,
                headers: dict[str, str] | None = None) -> None:
        body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 — http.server's name
        state = self.server.state
        if self.path != "/_stats":
            self._answer(404, {"error": f"no route {self.path}"})
            return
        with state.lock:
            doc = {**state.counts, "scorings": dict(state.scorings), "asked": dict(state.asked),
                   **state.knobs}
        self._answer(200, doc)

    def do_POST(self) -> None:  # noqa: N802
        state = self.server.state
        try:
            raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            doc = json.loads(raw or b"{}")
        except (ValueError, OSError) as exc:
            self._answer(400, {"error": f"unreadable body: {exc}"})
            return
        if self.path == "/_control":
            try:
                state.control(doc)
            except ValueError as exc:
                self._answer(400, {"error": str(exc)})
                return
            self._answer(200, {"ok": True})
            return
        with state.lock:
            state.counts["requests"] += 1
            state.counts["in_flight"] += 1
            state.counts["max_in_flight"] = max(state.counts["max_in_flight"], state.counts["in_flight"])
        try:
            self._score(state, doc)
        finally:
            with state.lock:
                state.counts["in_flight"] -= 1

    def _score(self, state: EndpointState, doc: Any) -> None:
        if state.auth is not None and self.headers.get("Authorization") != state.auth:
            self._answer(401, {"error": "wrong or missing Authorization header"})
            return
        key = self.headers.get("Idempotency-Key", "")
        if not key or not isinstance(doc, dict) or doc.get("trajectory_id") != key:
            self._answer(400, {"error": "Idempotency-Key must equal the body's trajectory_id"})
            return
        with state.lock:
            state.asked[key] = state.asked.get(key, 0) + 1
        # Faults first: a hung or failed request never claims its key, so the retry of a
        # hung one is not made to wait for it.
        if self._fault(state):
            return
        with state.lock:
            done = state.results.get(key)
            first = state.scoring.get(key)
            if done is None and first is None:
                mine = state.scoring[key] = threading.Event()
        if done is not None:
            self._answer(200, done)
            return
        if first is not None:  # a copy while the first is scored: its answer, once there
            first.wait()
            with state.lock:
                done = state.results.get(key)
            if done is not None:
                self._answer(200, done)
            else:
                self._answer(503, {"error": "the first copy of this key failed; retry"})
            return
        try:
            self._score_first(state, doc, key)
        finally:
            with state.lock:
                state.scoring.pop(key, None)
            mine.set()

    def _fault(self, state: EndpointState) -> bool:
        """Inject this request's fault, if it draws one; True if it did."""
        fault = state.fault()
        if fault == "hang":
            with state.lock:
                state.counts["hangs"] += 1
            state.stop.wait()  # until the server stops: the client's timeout must act
            return True
        if fault == "error":
            with state.lock:
                state.counts["errors"] += 1
                status = state.knobs["error_status"]
            self._answer(status, {"error": "injected failure"}, {"Retry-After": "0"})
            return True
        return False

    def _score_first(self, state: EndpointState, doc: dict[str, Any], key: str) -> None:
        with state.lock:
            latency = state.knobs["latency_s"]
        if latency > 0:
            time.sleep(latency)  # the scoring's own time: the key is claimed meanwhile
        if not (isinstance(doc.get("task"), str) and isinstance(doc.get("task_kwargs", {}), dict)
                and isinstance(doc.get("prompt"), dict) and isinstance(doc.get("completions"), list)):
            self._answer(400, {"error": "not the protocol: task, task_kwargs, prompt, completions"})
            return
        try:
            reward = state.score(doc)
        except Exception as exc:  # noqa: BLE001 — the reward's failure is the answer
            self._answer(422, {"error": f"{type(exc).__name__}: {exc}"})
            return
        body = json.dumps({"reward": reward, "info": {"scored_by": os.getpid()}}).encode()
        with state.lock:
            state.results[key] = body
            state.scorings[key] = state.scorings.get(key, 0) + 1
        self._answer(200, body)


class Server(ThreadingHTTPServer):
    daemon_threads = True  # a hung request must not keep the process alive

    def __init__(self, address: tuple[str, int], state: EndpointState) -> None:
        super().__init__(address, Handler)
        self.state = state


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    add_options(p, port=(0, "0: any free port (printed)"), latency_s=0.0, error_rate=0.0, error_status=503,
                hang_rate=0.0, seed=0)
    p.add_argument("--auth-file", help="require Authorization: <this file's content>")
    args = p.parse_args(argv)
    auth = None
    if args.auth_file:
        with open(args.auth_file, encoding="utf-8") as f:
            auth = f.read().strip()
    state = EndpointState(latency_s=args.latency_s, error_rate=args.error_rate,
                          error_status=args.error_status, hang_rate=args.hang_rate,
                          seed=args.seed, auth=auth)
    server = Server((args.host, args.port), state)
    host, port = server.server_address[:2]
    print(f"listening on http://{host}:{port}/score", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        state.stop.set()
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
