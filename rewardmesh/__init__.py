"""rewardmesh: streaming rewards and rollouts for RL post-training, over gRPC.

The public API a trainer needs, importable from the top level (loaded on first use, so `import rewardmesh.v1`
stays as light as the generated stubs):

    from rewardmesh import TrainerClient, PromptSpec, Sampling, RewardClient

The package is assembled from the repository's folders: `server/`, `client/`, `reward_engine/`, `common/`,
`demo/` and the generated contract `protos/rewardmesh/v1` (`rewardmesh.v1`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rewardmesh.client.batch import RolloutBatch, ScoredSample
    from rewardmesh.client.reward_client import RewardClient
    from rewardmesh.client.trainer import PromptSpec, Sampling, TrainerClient
    from rewardmesh.reward_engine.engine import RewardEngine

__version__ = "0.1.0"

_EXPORTS = {
    "TrainerClient": "rewardmesh.client.trainer",
    "PromptSpec": "rewardmesh.client.trainer",
    "Sampling": "rewardmesh.client.trainer",
    "RewardClient": "rewardmesh.client.reward_client",
    "ScoredSample": "rewardmesh.client.batch",
    "RolloutBatch": "rewardmesh.client.batch",
    "RewardEngine": "rewardmesh.reward_engine.engine",
}

__all__ = [
    "PromptSpec",
    "RewardClient",
    "RewardEngine",
    "RolloutBatch",
    "Sampling",
    "ScoredSample",
    "TrainerClient",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rewardmesh' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
