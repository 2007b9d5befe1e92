"""The sim engine's hardware profiles: how long a decode step, a prefill, a weight load take.

All times are *model* seconds (what the modelled GPU would take); the engine multiplies
them by its ``time_scale`` (wall seconds per model second). Pure Python on purpose: this
module is imported whenever a spec is validated (``engines.py``).

A decode step over ``n`` running requests that hold ``K`` KV tokens in total takes::

    base_s * max(1, n / roofline_batch) + kv_s_per_token * K

flat in ``n`` up to the roofline batch (decoding is memory-bound: each step reads all
weights once whatever the batch; Laminar §2.4, Fig. 4), linear beyond it (compute-bound),
plus the attention's read of every cached token. A request admitted at a step adds
``prefill_s_per_token * tokens_to_prefill`` to that step.

Every constant of a profile is *derived* below from a model's config.json figures and the
GPU's datasheet figures, so docs/design/sim.md can show the arithmetic and a reader can check it.
"""

from __future__ import annotations

import dataclasses

# NVIDIA H800 SXM5 80GB (the H100 SXM5 die with reduced NVLink): HBM3 3.35 TB/s,
# 989.4 TFLOPS dense bf16 (H100 SXM datasheet; the H800 keeps both figures).
H800_HBM_BYTES_PER_S = 3.35e12
H800_BF16_FLOPS = 989.4e12
H800_MEMORY_BYTES = 80e9
# NVIDIA H20 96GB (the bandwidth-optimised Hopper): HBM3 4.0 TB/s, 148 TFLOPS dense bf16
# (NVIDIA's H20 figures, as in RollArt Table 2).
H20_HBM_BYTES_PER_S = 4.0e12
H20_BF16_FLOPS = 148e12
H20_MEMORY_BYTES = 96e9
# vLLM's default gpu_memory_utilization: the share of GPU memory for weights + KV cache.
GPU_MEMORY_UTILIZATION = 0.9
# Per decode step, outside the roofline: scheduling, sampling, launch of the CUDA graph
# (an assumption, ~2 ms for vLLM-class engines; override with base_s when measured).
STEP_OVERHEAD_S = 2.0e-3
# One small all-reduce over NVLink (two per layer under tensor parallelism).
ALLREDUCE_S = 15e-6
# Achieved share of peak bf16 FLOPS during prefill (compute-bound; 40-60% is typical).
PREFILL_MFU = 0.5
# Host -> GPU copy of a weight shard (PCIe Gen5 x16 is 64 GB/s raw; ~25 GB/s achieved
# from pinned memory with the per-tensor overheads of a real load).
LOAD_BYTES_PER_S = 25e9
# vLLM's default max_num_seqs: concurrent sequences per engine.
MAX_BATCH = 256
BF16_BYTES = 2


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The config.json figures the timing model needs (Qwen2-style decoder, bf16)."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool

    def params(self) -> int:
        """Parameter count: attention (q, k, v with bias, o), SwiGLU MLP, two norms per
        layer, embeddings (twice when untied), final norm."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        attention = self.hidden * q + q + 2 * (self.hidden * kv + kv) + q * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        per_layer = attention + mlp + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * per_layer + embeddings + self.hidden

    def kv_bytes_per_token(self) -> int:
        """K and V of every layer: layers * 2 * kv_heads * head_dim * 2 bytes (bf16)."""
        return self.layers * 2 * self.kv_heads * self.head_dim * BF16_BYTES


# From the models' config.json on the Hugging Face hub (Qwen/Qwen2.5-7B, Qwen/Qwen2.5-32B).
QWEN25_7B = ModelShape("Qwen2.5-7B", layers=28, hidden=3584, intermediate=18944, heads=28,
                       kv_heads=4, head_dim=128, vocab=152064, tied_embeddings=False)
QWEN25_32B = ModelShape("Qwen2.5-32B", layers=64, hidden=5120, intermediate=27648, heads=40,
                        kv_heads=8, head_dim=128, vocab=152064, tied_embeddings=False)


@dataclasses.dataclass(frozen=True)
class GPU:
    """The datasheet figures the roofline needs, and a price: RollArt Table 2's normalised
    cost (H20 = 1.00, H800 = 2.85, its reference [69]), so fleets of equal cost compare."""

    name: str
    hbm_bytes_per_s: float
    bf16_flops: float
    memory_bytes: float
    cost: float


H800 = GPU("h800", H800_HBM_BYTES_PER_S, H800_BF16_FLOPS, H800_MEMORY_BYTES, cost=2.85)
H20 = GPU("h20", H20_HBM_BYTES_PER_S, H20_BF16_FLOPS, H20_MEMORY_BYTES, cost=1.00)


@dataclasses.dataclass(frozen=True)
class SimTiming:
    """One engine's constants, in model seconds and tokens."""

    base_s: float  # decode step latency up to the roofline batch
    roofline_batch: int  # B: the batch beyond which a step grows linearly
    kv_s_per_token: float  # per KV token held by the batch, per step
    prefill_s_per_token: float  # per prompt token prefilled
    kv_capacity_tokens: int  # KV cache size in tokens
    max_batch: int  # concurrent sequences
    load_s: float  # a weight load: nothing decodes meanwhile

    def step_s(self, n: int, kv_tokens: int) -> float:
        """One decode step of ``n`` requests holding ``kv_tokens`` (no prefill)."""
        return self.base_s * max(1.0, n / self.roofline_batch) + self.kv_s_per_token * kv_tokens


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    description: str
    timing: SimTiming
    hardware: str = "h800"  # the GPU's name: a sim rollout's default hardware label
    cost: float = 2.85  # per rollout (GPU.cost x tp): the price of one rollout of this profile


def derive(model: ModelShape, tp: int, gpu: GPU = H800) -> SimTiming:
    """A profile's constants from the roofline of ``model`` on ``tp`` GPUs (tensor parallel:
    each GPU holds and reads 1/tp of the weights and of each token's KV)."""
    weight_bytes = model.params() * BF16_BYTES
    overhead = STEP_OVERHEAD_S + (2 * model.layers * ALLREDUCE_S if tp > 1 else 0.0)
    kv_bytes = model.kv_bytes_per_token()
    usable = tp * gpu.memory_bytes * GPU_MEMORY_UTILIZATION
    return SimTiming(
        base_s=weight_bytes / tp / gpu.hbm_bytes_per_s + overhead,
        # Decode does 2 FLOPs per parameter per sequence and reads each weight byte pair
        # once per step: arithmetic intensity = n FLOPs/byte for a batch of n (bf16). The
        # ridge point (peak FLOPs / bandwidth) is where n stops being free.
        roofline_batch=int(gpu.bf16_flops / gpu.hbm_bytes_per_s),
        kv_s_per_token=kv_bytes / tp / gpu.hbm_bytes_per_s,
        prefill_s_per_token=2 * model.params() / (tp * gpu.bf16_flops * PREFILL_MFU),
        kv_capacity_tokens=int((usable - weight_bytes) // kv_bytes),
        max_batch=MAX_BATCH,
        load_s=weight_bytes / tp / LOAD_BYTES_PER_S,
    )


def profile(name: str, description: str, model: ModelShape, tp: int, gpu: GPU) -> Profile:
    return Profile(name, description, derive(model, tp, gpu), gpu.name, gpu.cost * tp)


PROFILES: dict[str, Profile] = {p.name: p for p in (
    profile("h800-7b", "Qwen2.5-7B bf16 on one H800 80GB (TP1)", QWEN25_7B, 1, H800),
    profile("h800-32b-tp4", "Qwen2.5-32B bf16 on four H800 80GB (TP4)", QWEN25_32B, 4, H800),
    # Prefill-slow (148 TFLOPS), decode-cheap (4.0 TB/s at 1/2.85 of an H800's price).
    profile("h20-7b", "Qwen2.5-7B bf16 on one H20 96GB (TP1)", QWEN25_7B, 1, H20),
)}
DEFAULT_PROFILE = "h800-7b"


def timing(profile: str, **overrides: float | int | None) -> SimTiming:
    """The profile's constants with each override that is not None in its place."""
    base = PROFILES[profile].timing
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
