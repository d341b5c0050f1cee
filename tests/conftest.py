"""Shared fixtures: tiny real models built once per session (no download)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rewardmesh.demo.tiny_models import TinyModelPaths, build_tiny_models

# tests/integrations/ drives verl, TRL and OpenRLHF, installed only in their own environment: `make test-integrations`.
collect_ignore = [] if os.environ.get("REWARDMESH_INTEGRATIONS") else ["integrations"]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModelPaths:
    out: Path = tmp_path_factory.mktemp("tiny-models")
    return build_tiny_models(out)
