"""Rollout engines behind one interface (api.py): the torch engine (torch_engine.py, its slots and
lean forward), vLLM (vllm_engine.py), and the seam's kinds ([rollout.engine], kinds.py)."""
