"""Generation backends: token ids in, token ids out, behind the Backend base class in base.py.

Backends are imported lazily so that choosing "hf" never imports vLLM and vice versa.
"""

from __future__ import annotations

from typing import Any

from rewardmesh.server.rollout.backends.base import Backend, GenerationOutput, GenerationRequest, WeightsError

BACKENDS = ("hf", "vllm")

__all__ = ["BACKENDS", "Backend", "GenerationOutput", "GenerationRequest", "WeightsError", "make_backend"]


def make_backend(name: str, model: str, **options: Any) -> Backend:
    """Build the backend called ``name`` for ``model``; options go to its constructor unchanged."""
    if name == "hf":
        from rewardmesh.server.rollout.backends.hf import HFBackend

        return HFBackend(model, **options)
    if name == "vllm":
        from rewardmesh.server.rollout.backends.vllm_backend import VLLMBackend

        return VLLMBackend(model, **options)
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(repr(b) for b in BACKENDS)}")
