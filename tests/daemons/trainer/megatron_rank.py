"""One rank of a multi-rank megatron learner, started by torchrun (test_megatron_parallel.py):

    torchrun --standalone --nproc_per_node N -m tests.daemons.trainer.megatron_rank OUT TP DP [save|resume CKPT]

Builds MegatronLearner over tiny-qwen2 on the CPU (gloo) with the given layout and trains
steps 1 and 2 on the test batch; ``save CKPT`` writes a checkpoint to CKPT after step 1,
``resume CKPT`` loads the newest checkpoint there first and trains step 2 only. Writes per
rank OUT/rank-<r>.json (each step's stats and the rank's place in the layout) and
OUT/rank-<r>-step-<s>.npz (its HF-named slice of the weights after step s, what it would
publish).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np


def main(out: Path, tensor: int, data: int, mode: str = "", ckpt: str = "") -> None:
    warnings.simplefilter("ignore")
    import torch.distributed as dist

    from rlfleet.daemons.trainer.checkpointing import checkpoints
    from rlfleet.daemons.trainer.megatron import learner as mb
    from tests.daemons.trainer.test_megatron_backend import TINY, turn_batch

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    learner = mb.MegatronLearner(TINY, lr=1e-2, seed=0, device="cpu", micro_batch_tokens=24,
                                 tensor_parallel=tensor, data_parallel=data)
    steps = {}
    if mode == "resume":
        assert learner.load_checkpoint(checkpoints(ckpt)[0]) == 1
    for step in (1, 2):
        if mode == "resume" and step == 1:
            continue
        steps[step] = learner.train_step(turn_batch())
        np.savez(out / f"rank-{rank}-step-{step}.npz", **learner.state_tensors())
        if mode == "save" and step == 1:
            learner.save_checkpoint(ckpt)
    (out / f"rank-{rank}.json").write_text(json.dumps(
        {"rank": rank, "tp_rank": learner.tp_rank, "dp_rank": learner.dp_rank, "steps": steps}))
    learner.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6])
