"""Shared fixtures: tiny real models built once per session (no download)."""

from __future__ import annotations

from pathlib import Path

import pytest

from demo.tiny_models import TinyModelPaths, build_tiny_models


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModelPaths:
    out: Path = tmp_path_factory.mktemp("tiny-models")
    return build_tiny_models(out)
