# rewardmesh: `make demo` and `make test` are all a newcomer needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU build of torch, installed before the project so pip never pulls a multi-GB CUDA build.
# GPU users: make TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" (or install torch first).
TORCH_SPEC ?= torch==2.13.0
PROTO_SRC := $(wildcard protos/rewardmesh/v1/*.proto)

.PHONY: install demo test lint typecheck pytest protos bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/rewardmesh demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest -q

test: lint typecheck pytest

# Regenerate the committed stubs; tests/test_protos.py fails when they are stale.
protos: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos --grpc_python_out=protos \
		--plugin=protoc-gen-mypy_grpc=$(BIN)/protoc-gen-mypy_grpc --mypy_grpc_out=protos $(PROTO_SRC)

bench: $(STAMP)
	$(BIN)/python -m bench.reward_batching

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
