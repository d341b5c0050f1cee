"""A named reward pipeline: weighted sources behind one dynamic batcher, which hands them only what they can
start (their declared capacity, combined here)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rewardmesh.reward_engine.batcher import BatcherConfig, BatchInfo, DynamicBatcher, StartLimits
from rewardmesh.reward_engine.ticket import Ticket
from rewardmesh.reward_engine.types import ApartResult, Outcome, RewardInput, RewardOutput, RewardSource

log = logging.getLogger(__name__)


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
        self.batcher = DynamicBatcher(
            self.compute,
            batching,
            name=name,
            on_batch=hook,
            limits=self.limits,
            start_delay=self.start_delay,
            start_each=self.start_each,
            compute_first=self.compute_first,
        )
        for ws in sources:
            ws.source.on_capacity(self.batcher.wake)

    def limits(self, *, lent: bool = True) -> StartLimits:
        """What the sources can have started at once: the least per-sample capacity of its per-sample sources
        (each sample goes to every source; with ``lent``, less what is held outside the pipeline now), the least
        batch capacity of its per-batch ones; inline when every source works on the event loop itself."""
        samples: int | None = None
        batches: int | None = None
        paced = False
        inline = True
        caps = [ws.source.capacity for ws in self.sources]
        for cap in caps:
            paced = paced or cap.paced
            if cap.inline:
                continue
            inline = False
            free = cap.free_for_pipeline if lent else cap.slots
            if cap.per == "sample":
                samples = free if samples is None else min(samples, free)
            else:
                batches = free if batches is None else min(batches, free)
        # Started work may be stopped for another tenant's only where one source does it all, per sample, and says
        # it can be (the batcher then holds each sample's own future: cancelling it stops the work).
        only = caps[0] if len(caps) == 1 and self.sources[0].weight == 1.0 else None
        preemptible = only is not None and only.preemptible and only.per == "sample" and not only.paced
        cost, aside = (only.stop_cost_s, only.aside) if only else (0.0, 0)
        # Likewise a batch runs ahead of those in flight only where one source scores it all (`compute_first`).
        overtakes = only is not None and only.overtakes
        return StartLimits(samples, batches, paced, inline, preemptible, cost, aside, overtakes)

    def effective_batching(self) -> BatcherConfig:
        """The batching this pipeline really runs, its knobs clamped to its sources' capacity (what ListRewards
        reports; see DynamicBatcher.effective_config)."""
        return self.batcher.effective_config(self.limits(lent=False))

    def start_delay(self) -> float:
        """Seconds before every source may start another sample (a paced source's rate limit)."""
        return max(ws.source.start_delay() for ws in self.sources)

    def describe_capacity(self) -> str:
        """Each source's capacity and what the batcher hands over, in words (logged when the server starts)."""
        each = "; ".join(f"{ws.source.kind} '{ws.source.name}': {ws.source.capacity.describe()}" for ws in self.sources)
        return f"{each}; hands over {self.batcher.describe_limits()}"

    def _declared_extras(self) -> list[str]:
        """The extras the sources declare, named as compute names them."""
        if len(self.sources) == 1:
            return list(self.sources[0].source.extra_keys)
        keys = []
        for ws in self.sources:
            name = ws.source.name
            keys += [f"{name}/score", *(f"{name}/{k}" for k in ws.source.extra_keys)]
        return keys

    def add(self, item: Ticket) -> Ticket:
        """Queue one sample on this pipeline (its batcher's one way in: `DynamicBatcher.add`)."""
        return self.batcher.add(item)

    def start_each(self, batch: list[RewardInput]) -> list[asyncio.Future[Outcome]] | None:
        """Each sample's weighted score as a future, its work started now, where the pipeline is one source that
        takes work per sample at its own weight (the batcher hands work over this way without a turn of the event
        loop); None otherwise (`compute`)."""
        if len(self.sources) != 1 or self.sources[0].weight != 1.0:
            return None
        return self.sources[0].source.start_each(batch)

    async def compute(self, batch: list[RewardInput]) -> ApartResult:
        """Each sample's weighted score, or a future of it where a source answers that sample apart (so a sample
        frees its slot when its own work is done, and one burning its budget holds neither its batch nor the
        batch's slot)."""
        per_source: list[ApartResult] = []
        whole = []  # sources that score whole batches: awaited together
        for k, ws in enumerate(self.sources):
            started = ws.source.start_each(batch)
            per_source.append(started if started is not None else [])
            if started is None:
                whole.append(k)
        if len(whole) == 1:  # awaited in place, no task: an inline source's batch runs in one turn of the loop
            per_source[whole[0]] = await self.sources[whole[0]].source.score_batch(batch)
        elif whole:
            scored = await asyncio.gather(*(self.sources[k].source.score_batch(batch) for k in whole))
            for k, results in zip(whole, scored, strict=True):
                per_source[k] = results
        if len(self.sources) == 1 and self.sources[0].weight == 1.0:  # the source's own outputs: no per-sample copy
            return per_source[0]
        combined: list[Outcome | asyncio.Future[Outcome]] = []
        for i in range(len(batch)):
            parts = [results[i] for results in per_source]
            if any(isinstance(part, asyncio.Future) for part in parts):  # a source answers this sample later
                combined.append(asyncio.ensure_future(self._combine_late(parts)))
            else:
                combined.append(self._combine(parts))  # type: ignore[arg-type]  # no future among them
        return combined

    async def compute_first(self, batch: list[RewardInput]) -> tuple[ApartResult, float]:
        """As `compute`, the batch run ahead of those in flight, which pause for it (where `limits` says the one
        source overtakes); also how long it waited for them to pause."""
        return await self.sources[0].source.score_batch_first(batch)

    def _combine(self, parts: list[Outcome]) -> Outcome:
        """One sample's weighted score from its sources' parts (a failed part fails the sample)."""
        single = len(self.sources) == 1
        score = 0.0
        extras: dict[str, float] = {}
        for ws, res in zip(self.sources, parts, strict=True):
            if isinstance(res, BaseException):
                return res
            score += ws.weight * res.score
            if single:
                extras.update(res.extras)
            else:
                extras[f"{ws.source.name}/score"] = res.score
                extras.update({f"{ws.source.name}/{k}": v for k, v in res.extras.items()})
        return RewardOutput(score, extras)

    async def _combine_late(self, parts: list[Any]) -> Outcome:
        """As _combine, once every late part is done (a failure is raised: the batcher answers it)."""
        done = [await part if isinstance(part, asyncio.Future) else part for part in parts]
        result = self._combine(done)
        if isinstance(result, BaseException):
            raise result
        return result

    async def warmup(self) -> None:
        for ws in self.sources:
            await ws.source.warmup()

    async def close(self, *, drain: bool = True) -> None:
        await self.batcher.close(drain=drain)
        for ws in self.sources:
            await ws.source.close()
