"""One trainer rank of the scale benchmark (tools/bench/scale.py starts it under torchrun):

    torchrun --standalone --nproc_per_node N -m rlfleet.tools.bench.scale_rank MODEL OUT TP DP PRECISION GROUPS SIZE

Builds the megatron learner's rank on the CPU (gloo), trains two steps on one batch
(the first allocates the optimizer state), then publishes its own slice: the HF-named
tensors in float32 and in bfloat16, each through the relay's manifest and byte range
(what a relay stores), timed. Data-parallel rank 0 of each tensor-parallel rank writes its
bfloat16 slice to OUT/slice-<tp rank>.safetensors for the rollout load; every rank writes
OUT/rank-<r>.json with its times, bytes and peak RSS.
"""

from __future__ import annotations

import json
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any


def publish(tensors: dict[str, Any], version: int) -> dict[str, Any]:
    """The relay's side of one publication: manifest (chunk checksums) and the byte range."""
    from rlfleet.relay.manifest import build_manifest

    started = time.perf_counter()
    manifest, source = build_manifest(version, tensors, chunk_bytes=32 << 20)
    source.to_bytearray()
    return {"bytes": manifest.total_bytes, "manifest_and_copy_s": round(time.perf_counter() - started, 3)}


def main(model: Path, out: Path, tensor: int, data: int, precision: str, groups: int, size: int) -> None:
    warnings.simplefilter("ignore")
    import torch.distributed as dist

    from rlfleet.common.tensors import to_torch
    from rlfleet.daemons.trainer.megatron.learner import MegatronLearner
    from rlfleet.tools.bench.megatron_check import make_batch

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    started = time.perf_counter()
    learner = MegatronLearner(model, lr=1e-5, seed=0, device="cpu", tensor_parallel=tensor,
                              data_parallel=data, precision=precision)
    record: dict[str, Any] = {"rank": rank, "tp_rank": learner.tp_rank, "dp_rank": learner.dp_rank,
                              "build_s": round(time.perf_counter() - started, 2)}
    batch = make_batch(learner.vocab_size, groups, size, seed=0)
    for key in ("first_step_s", "step_s"):
        dist.barrier()
        started = time.perf_counter()
        stats = learner.train_step(batch)
        record[key] = round(time.perf_counter() - started, 2)
    record["loss"], record["tokens"] = stats["loss"], stats["tokens"]
    record["published"] = {}
    for dtype in ("float32", "bfloat16"):
        started = time.perf_counter()
        tensors = learner.state_tensors(dtype)
        copy_s = time.perf_counter() - started
        record["published"][dtype] = {"copy_s": round(copy_s, 3), **publish(tensors, learner.version)}
        record["published"][dtype]["publish_s"] = round(copy_s + record["published"][dtype]["manifest_and_copy_s"], 3)
    if learner.dp_rank == 0:
        from safetensors.torch import save_file

        save_file({n: to_torch(a).contiguous() for n, a in tensors.items()
                   if not (learner.shape.tied and n == "lm_head.weight")},
                  str(out / f"slice-{learner.tp_rank}.safetensors"))
    record["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    (out / f"rank-{rank}.json").write_text(json.dumps(record))
    learner.close()


if __name__ == "__main__":
    model_dir, out_dir, tp, dp, prec, n_groups, group_size = sys.argv[1:8]
    main(Path(model_dir), Path(out_dir), int(tp), int(dp), prec, int(n_groups), int(group_size))
