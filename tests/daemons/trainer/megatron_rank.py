"""One rank of a multi-rank megatron learner, started by torchrun (test_megatron_parallel.py):

    torchrun --standalone --nproc_per_node N -m tests.daemons.trainer.megatron_rank OUT TP DP

Builds MegatronLearner over tiny-qwen2 on the CPU (gloo) with the given layout, trains two
steps on the test batch, and writes per rank OUT/rank-<r>.json (the steps' stats and the
rank's place in the layout) and OUT/rank-<r>-step-<s>.npz (its HF-named slice of the
weights after step s, what it would publish).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np


def main(out: Path, tensor: int, data: int) -> None:
    warnings.simplefilter("ignore")
    import torch.distributed as dist

    from rlfleet.daemons.trainer.megatron import learner as mb
    from tests.daemons.trainer.test_megatron_backend import TINY, turn_batch

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    learner = mb.MegatronLearner(TINY, lr=1e-2, seed=0, device="cpu", micro_batch_tokens=24,
                                 tensor_parallel=tensor, data_parallel=data)
    steps = []
    for step in (1, 2):
        steps.append(learner.train_step(turn_batch()))
        np.savez(out / f"rank-{rank}-step-{step}.npz", **learner.state_tensors())
    (out / f"rank-{rank}.json").write_text(json.dumps(
        {"rank": rank, "tp_rank": learner.tp_rank, "dp_rank": learner.dp_rank, "steps": steps}))
    learner.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
