"""The `verifiers` source type on a server without verifiers (tests/integrations/ drives it with verifiers): the
config that names it fails at start saying what to install, and every other pipeline is untouched by it."""

from __future__ import annotations

import importlib.util

import pytest

from rewardmesh.server.reward.server import build_engine

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("verifiers") is not None, reason="verifiers is installed here (make test-integrations)"
)


def test_a_verifiers_pipeline_without_verifiers_fails_at_start_saying_what_to_install() -> None:
    with pytest.raises(
        ValueError, match=r"type 'verifiers' needs the verifiers package.*pip install verifiers==0\.4\.0"
    ):
        build_engine({"hub": {"sources": [{"type": "verifiers", "taskset": "math-env"}]}})
    assert "gsm8k" in build_engine({}).pipelines  # without such a pipeline, nothing imports verifiers
