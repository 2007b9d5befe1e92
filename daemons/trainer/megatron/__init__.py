"""The megatron trainer backend (``[trainer.backend] kind = "megatron"``): the policy as a
megatron-core GPTModel, HF weights in and out.

- ``weights``: HF Qwen2 <-> megatron-core names and fused layouts, and each
  tensor-parallel rank's slice of them (torch only, no megatron import);
- ``layout``: the parallel layout (tensor x pipeline x data) and what a model shape allows;
- ``on_cpu``: the few places megatron-core names CUDA, pointed at the CPU at the edge;
- ``learner``: ``MegatronLearner``, the learner interface over one rank of the model.
"""
