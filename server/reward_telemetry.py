"""Reward-side telemetry per pipeline: metrics for every sample, spans for the samples kept.

Metrics: `rewardmesh.reward.{latency,queue_time,compute_time,batch_size}` histograms and
`rewardmesh.reward.{scored,failed,rejected,timed_out}` counters, collected in lists and handed to the SDK
in one call per instrument at each metric collection (`client.batched_metrics`): exact counts and bucket
shape at a fraction of the per-sample cost.

Spans: each sample's reward.queue / reward.compute and its batch's reward.batch (linked to the samples it
served) are recorded as plain fields in the flight recorder and built only when the sample is kept: its
traceparent says head-sampled, it failed here, or a KeepTraces call names it (a step's slowest).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping

import grpc
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import Link
from opentelemetry.util.types import AttributeValue

from client.batched_metrics import SECONDS_BUCKETS, SIZE_BUCKETS, HistogramBatch
from client.flight_recorder import FlightRecorder, link_to, new_span_id, new_trace_id
from client.telemetry import meter, metrics_enabled, recorder
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
_ODD_HEX = frozenset("13579bdfBDF")


class _Batch:
    """One executed batch, as its span would show it (built only if one of its samples is kept)."""

    __slots__ = ("info", "members", "pipeline", "span_id")

    def __init__(self, pipeline: str, info: BatchInfo, members: list[SampleRecord]) -> None:
        self.pipeline = pipeline
        self.info = info
        self.members = members
        self.span_id = 0  # set when exported (once)


class SampleRecord:
    """One sample's reward timeline on this server; also the batcher's per-sample context."""

    __slots__ = ("_link", "arrival_ns", "batch", "exported", "result", "traceparent")

    def __init__(self, traceparent: str) -> None:
        self.traceparent = traceparent
        self._link: Link | bool | None = False  # parsed on first use
        self.arrival_ns = 0
        self.result: reward_pb2.RewardResult | None = None
        self.batch: _Batch | None = None
        self.exported = False

    def link(self) -> Link | None:
        """A span link to this sample's reward span (what a reward.batch span points at)."""
        if self._link is False:
            self._link = link_to(self.traceparent)
        return self._link  # type: ignore[return-value]

    @property
    def sampled(self) -> bool:
        return self.traceparent[-1:] in _ODD_HEX  # the low bit of the trace flags

    def spans(self, rec: FlightRecorder) -> list[ReadableSpan]:
        link = self.link()
        result = self.result
        if link is None or result is None:
            return []
        trace_id, parent_id = link.context.trace_id, link.context.span_id
        attrs: dict[str, AttributeValue] = {
            "rewardmesh.sample_id": result.sample_id,
            "rewardmesh.pipeline": result.reward,
            "rewardmesh.batch.size": result.batch_size,
        }
        t0 = self.arrival_ns
        if result.HasField("error"):
            end = t0 + int(result.timing.total * 1e9)
            return [rec.span("reward.queue", trace_id, new_span_id(), parent_id, t0, end, attrs,
                             error=result.error.message)]  # fmt: skip
        queue_end = t0 + int(result.timing.queue * 1e9)
        compute_end = queue_end + int(result.timing.compute * 1e9)
        out = [
            rec.span("reward.queue", trace_id, new_span_id(), parent_id, t0, queue_end, attrs),
            rec.span("reward.compute", trace_id, new_span_id(), parent_id, queue_end, compute_end,
                     {**attrs, "rewardmesh.score": result.score}),
        ]  # fmt: skip
        batch = self.batch
        if batch is not None and not batch.span_id:  # the first kept sample of a batch exports its span
            batch.span_id = new_span_id()
            info = batch.info
            # Links to the served samples that are kept (exported): a link to a span never exported says
            # nothing, and parsing hundreds of contexts per batch would cost every sample.
            links = [link for m in batch.members if (m.exported or m.sampled) and (link := m.link()) is not None]
            batch_attrs: dict[str, AttributeValue] = {
                "rewardmesh.pipeline": batch.pipeline,
                "rewardmesh.batch.size": info.size,
                "rewardmesh.batch.padded_tokens": info.padded_tokens,
                "rewardmesh.batch.real_tokens": info.real_tokens,
            }
            # Its own trace: a batch serves many samples, so it links to them rather than having a parent.
            out.append(rec.span("reward.batch", new_trace_id(), batch.span_id, None, info.start_time_ns,
                                info.end_time_ns, batch_attrs, links=links))  # fmt: skip
        return out


_LIVE: weakref.WeakSet[RewardTelemetry] = weakref.WeakSet()


def _observe_all(options: CallbackOptions) -> list[Observation]:
    """Runs at every collection: first hand over what the hot paths collected, so the collection includes it."""
    out = []
    for t in list(_LIVE):
        t.pending.flush()
        out += [Observation(p.batcher.queue_depth, {"pipeline": name}) for name, p in t.engine.pipelines.items()]
    return out


class RewardTelemetry:
    """Hook points for the servicer: `begin` when a sample arrives, `on_result` when it is answered, `keep`."""

    def __init__(self, engine: RewardEngine) -> None:
        self.engine = engine
        m = meter()
        self.latency = m.create_histogram(
            "rewardmesh.reward.latency",
            unit="s",
            description="arrival to result on the reward server",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )
        self.queue_time = m.create_histogram(
            "rewardmesh.reward.queue_time", unit="s", explicit_bucket_boundaries_advisory=SECONDS_BUCKETS
        )
        self.compute_time = m.create_histogram(
            "rewardmesh.reward.compute_time", unit="s", explicit_bucket_boundaries_advisory=SECONDS_BUCKETS
        )
        self.batch_size = m.create_histogram(
            "rewardmesh.reward.batch_size", unit="{sample}", explicit_bucket_boundaries_advisory=SIZE_BUCKETS
        )
        self.scored = m.create_counter("rewardmesh.reward.scored", unit="{sample}")
        self.failed = m.create_counter("rewardmesh.reward.failed", unit="{sample}")
        self.rejected = m.create_counter("rewardmesh.reward.rejected", unit="{sample}")
        self.timed_out = m.create_counter("rewardmesh.reward.timed_out", unit="{sample}")
        # One callback per process (a second registration of the name is ignored), for every live server.
        m.create_observable_gauge("rewardmesh.reward.queue_depth", [_observe_all], unit="{sample}")
        self._timings = (self.latency, self.queue_time, self.compute_time)
        self.pending = HistogramBatch()
        self._key = id(self)  # this server's records in the process's ring
        engine.batch_listeners.append(self.on_batch)
        _LIVE.add(self)

    def begin(self, trace_context: Mapping[str, str] | None) -> SampleRecord | None:
        """A sample arrived with its own trace context: its record (the batcher's context for it), if tracing."""
        if not trace_context or recorder() is None:
            return None
        tp = trace_context.get("traceparent")
        return SampleRecord(tp) if tp else None

    def on_result(self, result: reward_pb2.RewardResult, record: SampleRecord | None, arrival_ns: int) -> None:
        """Count and time the sample; export its spans now if kept, else remember them for a KeepTraces."""
        failed = result.HasField("error")
        if metrics_enabled():
            if failed:
                code = result.error.code
                counter = self.timed_out if code == _TIMED_OUT else self.rejected if code in _REJECTED else self.failed
                self.pending.count(counter, result.reward)
            else:
                t = result.timing
                self.pending.add_row(self.scored, self._timings, result.reward, (t.total, t.queue, t.compute))
        if record is None:
            return  # tracing off, or the sample came without a trace context
        record.result = result
        record.arrival_ns = arrival_ns
        rec = recorder()
        if rec is None:
            return
        if failed or record.traceparent[-1:] in _ODD_HEX:  # failed here, or head-sampled (the flags' low bit)
            record.exported = True
            rec.export_tree(record)
        else:
            rec.remember((self._key, result.sample_id), record)

    def on_batch(self, pipeline: str, info: BatchInfo) -> None:
        if metrics_enabled():
            self.pending.add(self.batch_size, pipeline, info.size)
        members = [c for c in info.contexts if isinstance(c, SampleRecord)]
        if members:
            batch = _Batch(pipeline, info, members)
            for m in members:
                m.batch = batch

    def keep(self, sample_ids: Iterable[str]) -> tuple[int, int]:
        """Export the trees of these samples still in the ring: (samples known, spans exported)."""
        rec = recorder()
        if rec is None:
            return 0, 0
        found = rec.recall((self._key, sid) for sid in sample_ids)
        fresh = [r for r in found if isinstance(r, SampleRecord) and not r.exported]
        for record in fresh:  # all marked first, so a batch span links every kept sample of this call
            record.exported = True
        return len(found), sum(rec.export_tree(record) for record in fresh)
