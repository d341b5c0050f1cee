"""A step's telemetry on the trainer side: the metrics of its samples (verl's names, and how much reward time hid
behind generation), the step span's slowest-sample breakdown, and keeping the slowest samples' span trees."""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections.abc import Callable, Mapping, Sequence

from grpc import aio
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from rewardmesh.client.batch import ScoredSample, compute_metrics, slowest_sample
from rewardmesh.client.fanout import RolloutTarget
from rewardmesh.common.telemetry import recorder, trace_config
from rewardmesh.v1 import reward_pb2

log = logging.getLogger(__name__)

__all__ = ["SlowestTraces", "close_step_span", "reward_overlap", "step_metrics"]


def step_metrics(samples: Sequence[ScoredSample], gen_seconds: float) -> dict[str, float]:
    return {**compute_metrics(samples, gen_seconds), **reward_overlap(samples, gen_seconds)}


def close_step_span(span: trace.Span, samples: Sequence[ScoredSample], metrics: Mapping[str, float]) -> None:
    """The slowest-sample breakdown as attributes (the metrics' own names) and an event naming its trace."""
    if not span.is_recording() or not samples:
        return
    span.set_attributes({k: v for k, v in metrics.items() if k.startswith("timing_s/")})
    slow = slowest_sample(samples)
    parts = slow.trace_context.get("traceparent", "").split("-")
    event: dict[str, AttributeValue] = {"rewardmesh.sample_id": slow.sample_id, "rewardmesh.total_s": slow.total_time}
    if len(parts) == 4:
        event.update({"trace_id": parts[1], "span_id": parts[2]})
    span.set_attribute("rewardmesh.slowest.sample_id", slow.sample_id)
    span.add_event("slowest_sample", event)


def reward_overlap(samples: Sequence[ScoredSample], rollout_seconds: float) -> dict[str, float]:
    """How much reward time hid behind generation, from each sample's arrival and reward wait.

    A sample finished generating at `arrived - reward`; the step's reward time is the union of the
    intervals [generated, arrived]; the exposed part is what ran after the last sample finished generating.
    """
    intervals = sorted((s.arrived - s.timing["reward"], s.arrived) for s in samples if s.timing["reward"] > 0)
    if not intervals:
        return {"timing_s/reward_hidden": 0.0, "timing_s/reward_exposed": 0.0}
    busy, cur_start, cur_end = 0.0, intervals[0][0], intervals[0][1]
    for start, end in intervals[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    generation_done = max(s.arrived - s.timing["reward"] for s in samples)
    exposed = max(0.0, max(s.arrived for s in samples) - generation_done)
    return {"timing_s/reward_hidden": max(0.0, busy - exposed), "timing_s/reward_exposed": exposed}


class SlowestTraces:
    """After each step, every rollout server is asked to keep the span trees of the step's slowest samples (each
    forwards the ask to its reward targets); best effort, never failing a step."""

    def __init__(self, targets: Callable[[], Sequence[RolloutTarget]]) -> None:
        self._targets = targets
        self._keeping: set[asyncio.Task[None]] = set()

    def end_step(self, span: trace.Span, samples: Sequence[ScoredSample], metrics: Mapping[str, float]) -> None:
        """The step span's slowest-sample breakdown, and the step's slowest samples' span trees kept everywhere."""
        close_step_span(span, samples, metrics)
        k = trace_config().keep_slowest
        if not samples or not k or recorder() is None or not span.is_recording():
            return
        ids = [s.sample_id for s in heapq.nlargest(k, samples, key=lambda s: s.total_time)]
        task = asyncio.get_running_loop().create_task(self._keep_traces(ids))
        self._keeping.add(task)
        task.add_done_callback(self._keeping.discard)

    async def _keep_traces(self, sample_ids: list[str]) -> None:
        """KeepTraces on every rollout server (each forwards to its reward targets); best effort."""
        request = reward_pb2.KeepTracesRequest(sample_ids=sample_ids)

        async def one(t: RolloutTarget) -> None:
            try:
                await t.stub.KeepTraces(request, timeout=10.0)
            except aio.AioRpcError as exc:
                log.debug("KeepTraces on %s failed: %s", t.address, exc.code().name)

        await asyncio.gather(*(one(t) for t in self._targets()))

    async def close(self) -> None:
        """Wait for the last steps' KeepTraces calls (each has its own deadline)."""
        if self._keeping:
            await asyncio.gather(*self._keeping, return_exceptions=True)
