"""Text <-> token ids for the env-host's turns, exactly as the trainer's episodes see them."""

from __future__ import annotations

from typing import Any

from rlfleet.common.wire.arrays import Int32Array

_ENCODED_MAX = 4096  # prompt texts whose token ids TurnCodec keeps


class TurnCodec:
    """Text <-> token ids exactly as daemons/tasks/episodes.py does it: the tokenizer's
    post-processor puts <bos> in front of every prompt; a completion is cut at the
    first end token, which stays in the turn's token ids (the policy must learn to
    stop) but not in the decoded action text."""

    def __init__(self, tokenizer: Any) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id; completions could never end")
        self.tokenizer = tokenizer
        self.eos_id: int = tokenizer.eos_token_id
        self.vocab_size = len(tokenizer)
        self._backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
        # The group_size trajectories of a prompt start from the same observation: encode
        # it once. Bounded (cleared when full). Arrays are immutable: shared freely.
        self._encoded: dict[str, Int32Array] = {}

    @classmethod
    def from_model_dir(cls, path: str) -> TurnCodec:
        from transformers import AutoTokenizer  # heavy; only env-hosts pay for it

        return cls(AutoTokenizer.from_pretrained(str(path)))

    def encode_prompt(self, text: str) -> list[int]:
        if self._backend is not None:  # the same post-processor, ~10x less Python overhead
            return list(self._backend.encode(text).ids)
        return list(self.tokenizer(text)["input_ids"])

    def prompt_array(self, text: str) -> Int32Array:
        """encode_prompt as an array, remembered for the prompt's other trajectories."""
        ids = self._encoded.get(text)
        if ids is None:
            if len(self._encoded) >= _ENCODED_MAX:
                self._encoded.clear()
            ids = self._encoded[text] = Int32Array(self.encode_prompt(text))
        return ids

    def completion(self, token_ids: list[int], decode: bool = True) -> tuple[int, str]:
        """(how many tokens belong to the turn, including the end token; action text, ""
        when the task does not read it: ``Task.decodes_completion``)."""
        n = token_ids.index(self.eos_id) + 1 if self.eos_id in token_ids else len(token_ids)
        return n, self.tokenizer.decode(token_ids[:n], skip_special_tokens=True) if decode else ""
