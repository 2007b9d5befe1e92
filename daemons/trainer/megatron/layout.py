"""The trainer's parallel layout: tensor x pipeline x data parallel ranks, one process each.

Pure values (no torch, no megatron): ``rlfleet job validate`` asks ``problems`` of a spec's
layout and model shape before anything runs, and the learner asks it again at build.
Megatron-core orders the ranks (``parallel_state.initialize_model_parallel``: tensor
parallel innermost, then data, then pipeline), so this module only says what fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from .weights import ModelShape

# Built: tensor and data parallelism. Pipeline parallelism needs megatron's pipeline
# schedules (a forward/backward split across stages); not built yet, so refused by name.
MAX_PIPELINE_PARALLEL = 1


@dataclass(frozen=True)
class Layout:
    tensor: int = 1
    pipeline: int = 1
    data: int = 1

    @property
    def world(self) -> int:
        """Trainer processes (ranks) the layout needs."""
        return self.tensor * self.pipeline * self.data

    def describe(self) -> str:
        return f"TP {self.tensor} x PP {self.pipeline} x DP {self.data} = {self.world} ranks"

    def problems(self, shape: ModelShape | None = None) -> list[tuple[str, str]]:
        """(spec key, why) for each size the layout cannot take; empty when it fits.
        ``shape``: the model's, to check what tensor parallelism divides."""
        out: list[tuple[str, str]] = []
        for key, value in (("tensor_parallel", self.tensor), ("pipeline_parallel", self.pipeline),
                           ("data_parallel", self.data)):
            if value < 1:
                out.append((key, f"must be >= 1, got {value}"))
        if self.pipeline > MAX_PIPELINE_PARALLEL:
            out.append(("pipeline_parallel", f"{self.pipeline}: pipeline parallelism is not built yet "
                                             f"(tensor_parallel and data_parallel are); use 1"))
        if shape is not None and self.tensor > 1:
            # Each tensor-parallel rank holds whole heads, whole key/value groups, an equal
            # slice of the MLP and of the vocabulary (megatron-core's column/row split).
            for what, size in (("num_attention_heads", shape.heads), ("num_key_value_heads", shape.groups),
                               ("intermediate_size", shape.ffn), ("vocab_size", shape.vocab)):
                if size % self.tensor:
                    out.append(("tensor_parallel", f"{self.tensor} does not divide the model's {what} ({size})"))
        return out
