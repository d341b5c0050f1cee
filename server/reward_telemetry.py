"""Reward-side spans (reward.queue, reward.compute, reward.batch with links) and metrics, per pipeline."""

from __future__ import annotations

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import Link, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from client.telemetry import meter, tracer
from reward_engine.batcher import BatchInfo
from reward_engine.engine import RewardEngine
from rewardmesh.v1 import reward_pb2

_REJECTED = {
    c.value[0]
    for c in (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
    )
}
_TIMED_OUT = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


class RewardTelemetry:
    """Cheap when OpenTelemetry is off: the API's no-op tracer and meter do nothing."""

    def __init__(self, engine: RewardEngine) -> None:
        self.engine = engine
        m = meter()
        self.latency = m.create_histogram(
            "rewardmesh.reward.latency", unit="s", description="arrival to result on the reward server"
        )
        self.queue_time = m.create_histogram("rewardmesh.reward.queue_time", unit="s")
        self.compute_time = m.create_histogram("rewardmesh.reward.compute_time", unit="s")
        self.batch_size = m.create_histogram("rewardmesh.reward.batch_size", unit="{sample}")
        self.scored = m.create_counter("rewardmesh.reward.scored", unit="{sample}")
        self.failed = m.create_counter("rewardmesh.reward.failed", unit="{sample}")
        self.rejected = m.create_counter("rewardmesh.reward.rejected", unit="{sample}")
        self.timed_out = m.create_counter("rewardmesh.reward.timed_out", unit="{sample}")
        m.create_observable_gauge("rewardmesh.reward.queue_depth", [self._queue_depth], unit="{sample}")
        engine.batch_listeners.append(self.on_batch)

    def _queue_depth(self, options: CallbackOptions) -> list[Observation]:
        return [Observation(p.batcher.queue_depth, {"pipeline": name}) for name, p in self.engine.pipelines.items()]

    def on_result(self, result: reward_pb2.RewardResult, parent: Context | None, arrival_ns: int) -> None:
        """Record the sample's counters and histograms, and its queue/compute spans under its own context."""
        attrs = {"pipeline": result.reward}
        if result.HasField("error"):
            code = result.error.code
            counter = self.timed_out if code == _TIMED_OUT else self.rejected if code in _REJECTED else self.failed
            counter.add(1, attrs)
        else:
            self.scored.add(1, attrs)
            self.latency.record(result.timing.total, attrs)
            self.queue_time.record(result.timing.queue, attrs)
            self.compute_time.record(result.timing.compute, attrs)
        if parent is None:
            return
        span_attrs: dict[str, AttributeValue] = {
            "rewardmesh.sample_id": result.sample_id,
            "rewardmesh.pipeline": result.reward,
            "rewardmesh.batch.size": result.batch_size,
        }
        queue_end = arrival_ns + int(result.timing.queue * 1e9)
        queue = tracer().start_span("reward.queue", context=parent, start_time=arrival_ns, attributes=span_attrs)
        if result.HasField("error"):
            queue.set_status(Status(StatusCode.ERROR, result.error.message))
            queue.end(end_time=arrival_ns + int(result.timing.total * 1e9))
            return
        queue.end(end_time=queue_end)
        compute = tracer().start_span(
            "reward.compute",
            context=parent,
            start_time=queue_end,
            attributes={**span_attrs, "rewardmesh.score": result.score},
        )
        compute.end(end_time=queue_end + int(result.timing.compute * 1e9))

    def on_batch(self, pipeline: str, info: BatchInfo) -> None:
        self.batch_size.record(info.size, {"pipeline": pipeline})
        links = [Link(ctx) for ctx in info.contexts if isinstance(ctx, trace.SpanContext)]
        span = tracer().start_span(
            "reward.batch",
            context=trace.set_span_in_context(trace.INVALID_SPAN),  # its own trace: it serves many samples
            start_time=info.start_time_ns,
            links=links,
            attributes={
                "rewardmesh.pipeline": pipeline,
                "rewardmesh.batch.size": info.size,
                "rewardmesh.batch.padded_tokens": info.padded_tokens,
                "rewardmesh.batch.real_tokens": info.real_tokens,
            },
        )
        span.end(end_time=info.end_time_ns)
