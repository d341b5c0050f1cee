"""Shared fixtures: tiny real models built once per test run (no download), and the policy's tokenizer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from rewardmesh.demo.tiny_models import TinyModelPaths, build_tiny_models
from rewardmesh.server.reward.server import load_tokenizer

# tests/integrations/ drives verl, TRL and OpenRLHF, installed only in their own environment: `make test-integrations`.
collect_ignore = [] if os.environ.get("REWARDMESH_INTEGRATIONS") else ["integrations"]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModelPaths:
    out: Path = tmp_path_factory.mktemp("tiny-models")
    return build_tiny_models(out)


@pytest.fixture(scope="session")
def tok(tiny_models: TinyModelPaths) -> Any:
    """The tiny policy's tokenizer (read-only: tests encode and decode with it, none changes it)."""
    return load_tokenizer(str(tiny_models.policy))
