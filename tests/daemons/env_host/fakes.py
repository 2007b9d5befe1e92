"""Test doubles with real sockets: a rollout server on the real RequestServer, and the
character tokenizer the tiny model uses (built into a temp dir when the model is absent)."""

from __future__ import annotations

import functools
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlfleet.common.wire.arrays import Float32Array, Int32Array
from rlfleet.common.wire.messages import Abort, GenerateRequest, GenerateResult
from rlfleet.common.wire.sockets import RequestServer

REPO = Path(__file__).resolve().parents[3]


@functools.cache
def tokenizer_dir() -> Path:
    """A folder with the tiny model's tokenizer (and a config.json and an empty weights
    file, so specs accept it; nothing here loads weights)."""
    shipped = REPO / "models" / "tiny-qwen2"
    if (shipped / "tokenizer.json").exists() and (shipped / "config.json").exists():
        return shipped
    from rlfleet.tools.build_model import build_tokenizer

    out = Path(tempfile.mkdtemp(prefix="rlfleet-tok-"))
    build_tokenizer(out)
    # model_type decides how transformers loads the tokenizer (as for the real model).
    (out / "config.json").write_text('{"model_type": "qwen2"}')
    (out / "model.safetensors").write_bytes(b"")
    return out


@functools.cache
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir()))


# A behaviour gets (server, request) and returns a reply, or None for no reply at all.
Behaviour = Callable[["FakeRollout", GenerateRequest], GenerateResult | None]


def answer(text: str, version: int = 0, logprob: float = -0.5) -> Callable[..., GenerateResult]:
    """Reply with `text` followed by the end token."""
    def reply(_srv: FakeRollout, req: GenerateRequest) -> GenerateResult:
        tok = tokenizer()
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return GenerateResult(req.request_id, Int32Array(ids), Float32Array([logprob] * len(ids)),
                              version, "stop")
    return reply


def policy(fn: Callable[[str], str], version: int = 0) -> Behaviour:
    """Reply with fn(prompt text) + end token: a scripted 'model'."""
    def reply(srv: FakeRollout, req: GenerateRequest) -> GenerateResult:
        text = tokenizer().decode(req.prompt_token_ids.tolist(), skip_special_tokens=True)
        return answer(fn(text), version)(srv, req)
    return reply


class FakeRollout:
    """A rollout's `requests` endpoint on a real ROUTER socket, served by a thread."""

    def __init__(self, behaviour: Behaviour, name: str = "fake-rollout") -> None:
        self.behaviour = behaviour
        self.server = RequestServer("tcp://127.0.0.1:0", name=name)
        self.address = self.server.endpoint
        self.requests: list[GenerateRequest] = []
        self.aborts: list[str] = []
        self.got_request = threading.Event()
        self._stop = threading.Event()
        self._die = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name=name)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                got = self.server.recv(timeout=0.02)
                if self._die.is_set():
                    return
                if got is None:
                    continue
                ident, rid, msg = got
                if isinstance(msg, Abort):
                    self.aborts.append(msg.request_id)
                    self.server.reply(ident, rid, GenerateResult(
                        msg.request_id, Int32Array([]), Float32Array([]), 0, "abort"))
                    continue
                assert isinstance(msg, GenerateRequest)
                self.requests.append(msg)
                self.got_request.set()
                reply = self.behaviour(self, msg)
                if self._die.is_set():
                    return
                if reply is not None:
                    self.server.reply(ident, rid, reply)
        finally:
            self.server.close()

    def die(self) -> None:
        """Close the socket at once (what kill -9 does to the TCP connection)."""
        self._die.set()
        self._thread.join(5)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
