"""The reward engine's errors. They live in the common layer (rewardmesh.common.errors), which the wire helpers
share; this module names them for the engine's own code."""

from rewardmesh.common.errors import (
    Cancelled,
    DeadlineExceeded,
    DependencyFailed,
    InvalidInput,
    QueueFull,
    ResourceExhausted,
    RewardError,
    SourceFailed,
    Unavailable,
    UnknownReward,
)

__all__ = [
    "Cancelled",
    "DeadlineExceeded",
    "DependencyFailed",
    "InvalidInput",
    "QueueFull",
    "ResourceExhausted",
    "RewardError",
    "SourceFailed",
    "Unavailable",
    "UnknownReward",
]
