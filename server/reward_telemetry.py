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

import logging
import weakref
from collections import deque
from collections.abc import Iterable, Mapping

import grpc
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import Link
from opentelemetry.util.types import AttributeValue

from client.batched_metrics import SECONDS_BUCKETS, SIZE_BUCKETS, HistogramBatch
from client.flight_recorder import FlightRecorder, Ring, link_to, new_span_id, new_trace_id, parse_traceparent
from client.telemetry import meter, metrics_enabled, recorder, trace_config
from reward_engine.batcher import BatchInfo
from reward_engine.engine import RewardEngine
from rewardmesh.v1 import reward_pb2

log = logging.getLogger(__name__)

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

    __slots__ = ("info", "kept", "pipeline", "span_id")

    def __init__(self, pipeline: str, info: BatchInfo) -> None:
        self.pipeline = pipeline
        self.info = info  # its sample ids and contexts (traceparents) are the members
        self.kept: set[str] = set()  # members exported for a reason other than head sampling
        self.span_id = 0  # set when exported (once)

    def links(self) -> list[Link]:
        """Links to the served samples that are kept: a link to a span never exported says nothing."""
        kept = self.kept
        out = []
        for sid, tp in zip(self.info.sample_ids, self.info.contexts, strict=True):
            if type(tp) is str and (tp[-1:] in _ODD_HEX or sid in kept) and (link := link_to(tp)) is not None:
                out.append(link)
        return out


# A sample's record in the ring: plain numbers and strings, so the garbage collector untracks it (a ring of
# tracked objects costs a full collection every few thousand samples: most of what telemetry cost).
_Record = tuple[str, str, str, int, float, int, tuple[float, float, float], str, int]
# (sample id, pipeline, traceparent, arrival ns, score, batch size, (total, queue, compute) s, error, batch no)


def _spans(rec: FlightRecorder, r: _Record, batch: _Batch | None) -> list[ReadableSpan]:
    """A kept sample's reward.queue / reward.compute spans (one reward.queue span with the error if it failed)
    under its reward span, plus `batch`'s span when given (the first kept sample of a batch exports it)."""
    sid, pipeline, tp, t0, score, batch_size, (total, queue, compute), error, _ = r
    parsed = parse_traceparent(tp)
    if parsed is None:
        return []
    trace_id, parent_id, _ = parsed
    attrs: dict[str, AttributeValue] = {
        "rewardmesh.sample_id": sid,
        "rewardmesh.pipeline": pipeline,
        "rewardmesh.batch.size": batch_size,
    }
    if error:
        end = t0 + int(total * 1e9)
        return [rec.span("reward.queue", trace_id, new_span_id(), parent_id, t0, end, attrs, error=error)]
    queue_end = t0 + int(queue * 1e9)
    compute_end = queue_end + int(compute * 1e9)
    out = [
        rec.span("reward.queue", trace_id, new_span_id(), parent_id, t0, queue_end, attrs),
        rec.span("reward.compute", trace_id, new_span_id(), parent_id, queue_end, compute_end,
                 {**attrs, "rewardmesh.score": score}),
    ]  # fmt: skip
    if batch is not None:  # this sample exports its batch's span (its id was drawn when that was decided)
        info = batch.info
        batch_attrs: dict[str, AttributeValue] = {
            "rewardmesh.pipeline": batch.pipeline,
            "rewardmesh.batch.size": info.size,
            "rewardmesh.batch.padded_tokens": info.padded_tokens,
            "rewardmesh.batch.real_tokens": info.real_tokens,
        }
        # Its own trace: a batch serves many samples, so it links to them rather than having a parent.
        out.append(rec.span("reward.batch", new_trace_id(), batch.span_id, None, info.start_time_ns,
                            info.end_time_ns, batch_attrs, links=batch.links()))  # fmt: skip
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
        capacity = trace_config().ring_size
        self._ring = Ring(capacity)  # sample id -> _Record, for a later KeepTraces
        self._batches = Ring(max(16, capacity // 8))  # batch number -> _Batch
        self._batch_of: dict[str, int] = {}  # traceparent -> batch number, between the batch and its results
        self._batch_no = 0
        self._rows: dict[str, list[tuple[float, ...]]] = {}  # pipeline -> its pending timing rows
        # Kept samples' records waiting to become spans: (record, exports its batch's span).
        self._deferred: deque[tuple[_Record, bool]] = deque()
        self._registered = False
        engine.batch_listeners.append(self.on_batch)
        _LIVE.add(self)

    def begin(self, trace_context: Mapping[str, str] | None) -> str | None:
        """A sample arrived with its own trace context: its traceparent (the batcher's context for it), if tracing."""
        if not trace_context or recorder() is None:
            return None
        return trace_context["traceparent"] if "traceparent" in trace_context else None

    def on_result(self, result: reward_pb2.RewardResult, record: object, arrival_ns: int) -> None:
        """Count and time the sample; export its spans now if kept, else remember them for a KeepTraces.

        `record`: what `begin` returned. Per scored sample: a few field reads, a list append, a dict store.
        """
        if result.HasField("error"):
            self._on_failure(result, record, arrival_ns)
            return
        pipeline = result.reward
        t = result.timing
        row = (t.total, t.queue, t.compute)
        if metrics_enabled():
            rows = self._rows.get(pipeline)
            if rows is None:
                rows = self._rows[pipeline] = self.pending.rows(self.scored, self._timings, pipeline)
            rows.append(row)
            if len(rows) >= self.pending.max_pending:
                self.pending.flush()
        if type(record) is not str or (rec := recorder()) is None:
            return  # tracing off, or the sample came without a trace context
        r: _Record = (result.sample_id, pipeline, record, arrival_ns, result.score, result.batch_size, row, "",
                      self._batch_of.pop(record, 0))  # fmt: skip
        if record[-1:] in _ODD_HEX:  # head-sampled (the flags' low bit)
            self._export(rec, r, self._batches.get(r[-1]))
        else:
            self._ring.put(r[0], r)

    def _on_failure(self, result: reward_pb2.RewardResult, record: object, arrival_ns: int) -> None:
        """A failed sample: counted by kind, and its span exported at once (the decision is made here)."""
        pipeline = result.reward
        if metrics_enabled():
            code = result.error.code
            counter = self.timed_out if code == _TIMED_OUT else self.rejected if code in _REJECTED else self.failed
            self.pending.count(counter, pipeline)
        if type(record) is not str or (rec := recorder()) is None:
            return
        batch_no = self._batch_of.pop(record, 0)
        t = result.timing
        r: _Record = (result.sample_id, pipeline, record, arrival_ns, 0.0, result.batch_size,
                      (t.total, t.queue, t.compute), result.error.message or "failed", batch_no)  # fmt: skip
        batch = self._batches.get(batch_no) if batch_no else None
        if batch is not None:
            batch.kept.add(r[0])
        self._export(rec, r, batch)

    def on_batch(self, pipeline: str, info: BatchInfo) -> None:
        """A batch ran (before its samples' results are handed back): remember it by number for their spans."""
        if metrics_enabled():
            self.pending.add(self.batch_size, pipeline, info.size)
        if recorder() is None:
            return
        self._batch_no += 1
        self._batches.put(self._batch_no, _Batch(pipeline, info))
        batch_of = self._batch_of
        if len(batch_of) > 65536:  # samples never answered (cancelled between batch and result): let them go
            batch_of.clear()
        batch_of.update(dict.fromkeys(info.contexts, self._batch_no))  # type: ignore[arg-type]  # None: no context

    def _export(self, rec: FlightRecorder, r: _Record, batch: _Batch | None) -> int:
        """Queue a kept sample's spans (built in the recorder's builder thread); how many it will export."""
        owns_batch = batch is not None and not batch.span_id  # the first kept sample of a batch exports its span
        if owns_batch:
            batch.span_id = new_span_id()  # type: ignore[union-attr]
        deferred = self._deferred
        if not deferred and not self._registered:
            rec.add_source(self._drain)
            self._registered = True
        deferred.append((r, owns_batch))
        if len(deferred) >= 256:
            rec.wake()
        return (1 if r[7] else 2) + owns_batch

    def _drain(self) -> list[ReadableSpan]:
        """The spans of the kept samples queued so far (the builder thread's call)."""
        rec = recorder()
        out: list[ReadableSpan] = []
        popleft = self._deferred.popleft
        while True:
            try:
                r, owns_batch = popleft()
            except IndexError:
                return out
            if rec is None:
                continue
            try:
                out += _spans(rec, r, self._batches.get(r[-1]) if owns_batch else None)
            except Exception:  # telemetry must never cost a sample its result
                log.debug("could not build the spans of a kept sample", exc_info=True)

    def keep(self, sample_ids: Iterable[str]) -> tuple[int, int]:
        """Export the trees of these samples still in the ring: (samples known, spans exported)."""
        rec = recorder()
        if rec is None:
            return 0, 0
        ring = self._ring
        known = [r for sid in dict.fromkeys(sample_ids) if (r := ring.get(sid)) is not None]
        found: list[_Record] = [r for r in known if r]  # () marks a sample exported by an earlier call
        for r in found:
            ring.put(r[0], ())
        batches = [self._batches.get(r[-1]) for r in found]
        for r, batch in zip(found, batches, strict=True):  # all marked first: a batch span links every kept sample
            if batch is not None:
                batch.kept.add(r[0])
        return len(known), sum(self._export(rec, r, b) for r, b in zip(found, batches, strict=True))
