"""A named reward pipeline: weighted sources behind one dynamic batcher."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rewardmesh.reward_engine.batcher import BatcherConfig, BatchInfo, DynamicBatcher, Scored, Sink, Ticket
from rewardmesh.reward_engine.types import BatchResult, RewardInput, RewardOutput, RewardSource


@dataclass
class WeightedSource:
    source: RewardSource
    weight: float = 1.0


class RewardPipeline:
    """Scores a batch with every source at once and sums the weighted scores.

    Extras of a one-source pipeline keep their names (acc, format, pred ..., as verl reports them);
    with several sources each is prefixed with its source's name, and each source's own score is
    reported as `<source>/score`. A sample fails if any of its sources fails it.
    """

    def __init__(
        self,
        name: str,
        sources: list[WeightedSource],
        batching: BatcherConfig | None = None,
        *,
        description: str = "",
        on_batch: Callable[[str, BatchInfo], None] | None = None,
        extra_keys: tuple[str, ...] | None = None,
    ) -> None:
        if not sources:
            raise ValueError(f"pipeline '{name}' needs at least one source")
        names = [ws.source.name for ws in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"pipeline '{name}': source names must be unique, got {names}")
        self.name = name
        self.description = description
        self.sources = sources
        self.extra_keys = tuple(sorted(extra_keys if extra_keys is not None else self._declared_extras()))
        hook = (lambda info: on_batch(name, info)) if on_batch else None
        self.batcher = DynamicBatcher(self.compute, batching, name=name, on_batch=hook)

    def _declared_extras(self) -> list[str]:
        """The extras the sources declare (a source without `extra_keys` declares none), named as compute names
        them."""
        if len(self.sources) == 1:
            return list(getattr(self.sources[0].source, "extra_keys", ()))
        keys = []
        for ws in self.sources:
            name = ws.source.name
            keys += [f"{name}/score", *(f"{name}/{k}" for k in getattr(ws.source, "extra_keys", ()))]
        return keys

    async def score(self, inp: RewardInput, *, deadline: float | None = None, context: object = None) -> Scored:
        return await self.batcher.submit(inp, deadline=deadline, context=context)

    def put(
        self,
        inp: RewardInput,
        sink: Sink,
        token: Any = None,
        *,
        deadline: float | None = None,
        context: object = None,
        now: float | None = None,
    ) -> Ticket:
        """Queue one sample, its outcome to `sink(token, outcome)` (see DynamicBatcher.put)."""
        return self.batcher.put(inp, sink, token, deadline=deadline, context=context, now=now)

    def queue(self, item: Ticket) -> None:
        """Queue a ticket the caller built (see DynamicBatcher.queue)."""
        self.batcher.queue(item)

    async def compute(self, batch: list[RewardInput]) -> BatchResult:
        if len(self.sources) == 1:  # no gather: it would wrap the one call in a task of its own
            only = self.sources[0]
            results = await only.source.score_batch(batch)
            if only.weight == 1.0:  # the source's own outputs are the pipeline's: no per-sample copy
                return results if isinstance(results, list) else list(results)
            per_source = [results]
        else:
            per_source = await asyncio.gather(*(ws.source.score_batch(batch) for ws in self.sources))
        single = len(self.sources) == 1
        combined: BatchResult = []
        for i in range(len(batch)):
            score = 0.0
            extras: dict[str, float] = {}
            failure: BaseException | None = None
            for ws, results in zip(self.sources, per_source, strict=True):
                res = results[i]
                if isinstance(res, BaseException):
                    failure = res
                    break
                score += ws.weight * res.score
                if single:
                    extras.update(res.extras)
                else:
                    extras[f"{ws.source.name}/score"] = res.score
                    extras.update({f"{ws.source.name}/{k}": v for k, v in res.extras.items()})
            combined.append(failure if failure is not None else RewardOutput(score, extras))
        return combined

    async def warmup(self) -> None:
        for ws in self.sources:
            warm = getattr(ws.source, "warmup", None)
            if warm is not None:
                await warm()

    async def close(self, *, drain: bool = True) -> None:
        await self.batcher.close(drain=drain)
        for ws in self.sources:
            await ws.source.close()
