"""A reward pipeline with a fixed service time per batch: what a reward model on an accelerator looks like from
the batcher (a batch takes its time whatever its size, up to max_batch_size), without using the CPU that the
servers and clients of a benchmark or test on one small machine need. For fair-share, deadline and fleet-size
measurements, where the capacity of a reward server must be known and steady."""

from __future__ import annotations

import asyncio
from typing import Any

from rewardmesh.reward_engine.batcher import BatcherConfig
from rewardmesh.reward_engine.engine import RewardEngine
from rewardmesh.reward_engine.pipeline import RewardPipeline, WeightedSource
from rewardmesh.reward_engine.types import BatchResult, Capacity, RewardInput, RewardOutput, RewardSource, SourceKind

PIPELINE = "paced"


class PacedSource(RewardSource):
    """Scores every sample 1.0 after `batch_s` seconds per batch (the time passes, the CPU stays free), up to
    `batches` batches at once (its declared capacity)."""

    kind = SourceKind.MODEL

    def __init__(self, name: str = PIPELINE, batch_s: float = 0.02, batches: int = 1) -> None:
        self.name = name
        self.target = f"paced:{batch_s:g}s"
        self.batch_s = batch_s
        self._capacity = Capacity(batches, "batches at once", "batch")
        self.batches = 0
        self.samples = 0

    @property
    def capacity(self) -> Capacity:
        return self._capacity

    async def score_batch(self, batch: list[RewardInput]) -> BatchResult:
        await asyncio.sleep(self.batch_s)
        self.batches += 1
        self.samples += len(batch)
        return [RewardOutput(1.0) for _ in batch]


def paced_engine(batch_s: float = 0.02, max_batch_size: int = 8, **batching: Any) -> RewardEngine:
    """An engine with one pipeline, `paced`: capacity max_batch_size / batch_s samples per second per batch in
    flight (one, unless `max_concurrent_batches` says more)."""
    engine = RewardEngine()
    config = BatcherConfig(
        **{"max_batch_size": max_batch_size, "max_queue_delay_ms": 0, "max_concurrent_batches": 1, **batching}
    )
    source = PacedSource(batch_s=batch_s, batches=config.max_concurrent_batches)
    engine.add(
        RewardPipeline(
            PIPELINE,
            [WeightedSource(source)],
            config,
            description=f"fixed service time: {batch_s:g}s per batch of up to {max_batch_size}",
            on_batch=engine._on_batch,
        )
    )
    return engine
