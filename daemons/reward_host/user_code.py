"""The ``user_code`` reward backend: a reward function given as Python source in the
spec, run in the sandbox (common/sandbox/parent.py, docs/operations/sandbox.md), one child per trajectory.

    [reward_host.backend]
    kind = "user_code"
    concurrency = 4            # sandboxed children at once
    timeout_s = 5.0            # wall clock per trajectory; the child is SIGKILLed after it
    cpu_s = 2                  # RLIMIT_CPU
    memory_mib = 256           # RLIMIT_AS
    entry = "reward"           # the function the source defines
    source = '''
    def reward(question, answer, completions):
        return 1.0 if completions[-1].strip() == answer else 0.0
    '''

The function gets the prompt's question and answer and the completion of every turn
(all ``str``; ``completions`` a list) and returns a finite number. The source travels in
the spec (through etcd), not as a path, so every reward-host of the job runs the same
code. ``rlfleet job validate`` compiles it and checks that it defines ``entry``; it is
never imported into a daemon: it runs only in the sandbox's child, as a uid of its own,
with no network, a read-only file system and a private temporary directory.

Whatever goes wrong ends as that trajectory's outcome with ``error`` set (reward 0):
the sandbox's reason ("timeout", "cpu_limit", "memory_limit", "fork_limit",
"network_denied", "write_denied", "exception", ...), a result that is not a finite
number, or no result. The backend keeps serving; the service forwards the error as the
trajectory's ``reward_error``, so nothing is lost.

Runs go on a thread pool (each ``Sandbox.run`` blocks on its child); a finished run
writes a byte to a pipe, which is the backend's one fd for the service's poller.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from pydantic import StrictStr, field_validator, model_validator

from rlfleet.common.spec.fields import PosFloat, PosInt
from rlfleet.common.spec.registry import Kind, KindConfig

from .backends import RewardBackend

log = logging.getLogger("rlfleet.reward_host")

_ERROR_CHARS = 500
# The line the harness prints last: a prefix no reward function prints by accident.
_RESULT_PREFIX = "\x1erlfleet-reward "


class UserCodeConfig(KindConfig):
    kind: Literal["user_code"] = "user_code"
    source: StrictStr  # Python source defining `entry`
    entry: StrictStr = "reward"
    concurrency: PosInt = 4
    timeout_s: PosFloat = 5.0
    cpu_s: PosInt = 2
    memory_mib: PosInt = 256
    tmp_mib: PosInt = 16
    nproc: PosInt = 16

    @field_validator("entry")
    @classmethod
    def _entry_is_a_name(cls, v: str) -> str:
        if not v.isidentifier():
            raise ValueError(f"must be a Python identifier, got {v!r}")
        return v

    @model_validator(mode="after")
    def _source_defines_entry(self) -> UserCodeConfig:
        try:
            tree = ast.parse(self.source, "<reward_host.backend.source>")
        except SyntaxError as exc:
            raise ValueError(f"source: line {exc.lineno}: {exc.msg}") from None
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        defined |= {t.id for n in tree.body if isinstance(n, ast.Assign)
                    for t in n.targets if isinstance(t, ast.Name)}
        if self.entry not in defined:
            raise ValueError(f"source: defines no top-level function {self.entry!r} (entry)")
        if self.cpu_s > self.timeout_s + 1:
            raise ValueError(f"cpu_s ({self.cpu_s}) above timeout_s ({self.timeout_s}): "
                             "the wall clock would always stop the run first")
        return self


def harness(source: str, entry: str, question: str, answer: str, completions: list[str]) -> str:
    """The program the sandbox runs: the user's source, then a call of ``entry`` on this
    trajectory. The trajectory is data (a JSON string literal), never spliced as code."""
    job = json.dumps({"question": question, "answer": answer, "completions": completions})
    return (f"{source}\n\n"
            "import json as _rlfleet_json\n"
            f"_rlfleet_job = _rlfleet_json.loads({job!r})\n"
            f"_rlfleet_value = {entry}(_rlfleet_job['question'], _rlfleet_job['answer'], "
            "_rlfleet_job['completions'])\n"
            f"print({_RESULT_PREFIX!r} + _rlfleet_json.dumps(float(_rlfleet_value)))\n")


def parse_result(stdout: str) -> float:
    """The reward from the child's output (its last result line); ValueError if none."""
    for line in reversed(stdout.split("\n")):  # not splitlines(): it splits at \x1e too
        if line.startswith(_RESULT_PREFIX):
            value = float(json.loads(line[len(_RESULT_PREFIX):]))
            if not math.isfinite(value):
                raise ValueError(f"the reward function returned {value!r}")
            return value
    raise ValueError("the reward function printed no result")


class UserCodePool(RewardBackend):
    """Scores each job in a sandboxed child; ``concurrency`` at once. One owner thread."""

    def __init__(self, config: UserCodeConfig, *, sandbox: Any = None) -> None:
        from rlfleet.common.sandbox.parent import Sandbox, SandboxLimits

        self.config = config
        self.sandbox = sandbox or Sandbox(SandboxLimits(
            wall_s=config.timeout_s, cpu_s=config.cpu_s, memory_mib=config.memory_mib,
            nproc=config.nproc, tmp_mib=config.tmp_mib))
        self._executor = ThreadPoolExecutor(config.concurrency, thread_name_prefix="user-reward")
        self._done: list[Any] = []
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.running = 0
        self.errors: dict[str, int] = {}  # by sandbox reason, for the logs and tests

    def submit(self, job: Any) -> None:
        self.running += 1
        self._executor.submit(self._score, job)

    def poll(self, timeout: float = 0.0) -> list[Any]:
        import select

        if timeout > 0 and not self._done:
            select.select([self._wake_r], [], [], timeout)
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            out, self._done = self._done, []
        self.running -= len(out)
        return out

    def fds(self) -> list[int]:
        return [self._wake_r]

    def next_deadline_in(self) -> float:
        return math.inf  # the sandbox enforces each run's wall clock itself

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def _score(self, job: Any) -> None:
        from .workers import RewardOutcome

        c = self.config
        try:
            result = self.sandbox.run(harness(c.source, c.entry, job.prompt.question,
                                              job.prompt.answer, list(job.texts)))
            if not result.ok:
                error = f"sandbox: {result.reason}" + (f" ({result.detail})" if result.detail else "")
                self.errors[result.reason] = self.errors.get(result.reason, 0) + 1
                outcome = RewardOutcome(job.key, 0.0, error[:_ERROR_CHARS], result.wall_s)
            else:
                outcome = RewardOutcome(job.key, parse_result(result.stdout), "", result.wall_s)
        except Exception as exc:  # noqa: BLE001 — any failure is this trajectory's, never the host's
            outcome = RewardOutcome(job.key, 0.0, f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS])
        with self._lock:
            self._done.append(outcome)
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (the owner will drain it) or closed (shutting down)


class UserCode(Kind):
    Config = UserCodeConfig

    @classmethod
    def uses_sandbox(cls, config: UserCodeConfig, /) -> bool:
        return True

    @classmethod
    def build(cls, config: UserCodeConfig, /, **_: Any) -> RewardBackend:
        pool = UserCodePool(config)
        probe_sandbox(pool.sandbox)
        return pool


def probe_sandbox(sandbox: Any) -> None:
    """Run a trivial program once, so that a host that cannot confine user code (not
    root, no namespaces) refuses to start with the reason, rather than failing every
    trajectory."""
    from rlfleet.common.sandbox.parent import SandboxUnavailable

    try:
        result = sandbox.run("print(1)")
    except SandboxUnavailable as exc:
        raise RuntimeError(f"[reward_host.backend] kind = \"user_code\" needs the sandbox, "
                           f"which cannot run here (docs/operations/sandbox.md): {exc}") from None
    if not result.ok:
        raise RuntimeError(f"the sandbox failed a trivial program: {result.reason} {result.detail}")
