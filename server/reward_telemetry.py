"""Reward-side telemetry per pipeline: metrics for every sample, spans for the samples kept.

Scored samples cost telemetry nothing one by one: the batcher hands over each executed batch with every
sample's queue time and outcome (`BatchInfo`), and that batch is the record.

Metrics: `rewardmesh.reward.{latency,queue_time,compute_time,batch_size}` histograms and
`rewardmesh.reward.{scored,failed,rejected,timed_out}` counters, collected per batch in lists and handed to
the SDK in one call per instrument at each metric collection (`client.batched_metrics`): exact counts and
bucket shape at a fraction of the per-sample cost. Latency is arrival to result (queue + compute).

Spans: each sample's reward.queue / reward.compute and its batch's reward.batch (linked to the samples it
served) are built only when the sample is kept: its traceparent says head-sampled, it failed here, or a
KeepTraces call names it (a step's slowest). Until then the recent batches and an index of which batch
served each sample id are all that is kept (one C-level dict update per batch).
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
from client.flight_recorder import FlightRecorder, link_to, new_span_id, new_trace_id, parse_traceparent
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
    """One executed batch, as its span and its members' spans would show it (built only if one is kept).

    Members are kept in tuples of strings and numbers (the garbage collector untracks those): the batcher's
    BatchInfo holds tracked objects (outputs with dicts), and a ring of them costs full collections."""

    __slots__ = ("compute_s", "contexts", "end_ns", "kept", "number", "padded_tokens", "pipeline", "queue_s",
                 "real_tokens", "sample_ids", "scores", "span_id", "start_ns")  # fmt: skip

    def __init__(self, number: int, pipeline: str, info: BatchInfo, scores: list[float | None]) -> None:
        self.number = number
        self.pipeline = pipeline
        self.sample_ids = tuple(info.sample_ids)
        self.contexts = tuple(info.contexts)  # traceparents (or None)
        self.queue_s = tuple(info.queue_s)
        self.scores = tuple(scores)  # None: the member failed (its span is exported by on_failure)
        self.compute_s = info.compute_s
        self.start_ns, self.end_ns = info.start_time_ns, info.end_time_ns
        self.padded_tokens, self.real_tokens = info.padded_tokens, info.real_tokens
        self.kept: set[str] | None = None  # members whose spans are exported (or queued for export)
        self.span_id = 0  # set when exported (once)

    def keep(self, sample_id: str) -> bool:
        """Mark a member kept; False if it already was."""
        if self.kept is None:
            self.kept = set()
        elif sample_id in self.kept:
            return False
        self.kept.add(sample_id)
        return True

    def links(self) -> list[Link]:
        """Links to the served samples that are kept: a link to a span never exported says nothing."""
        kept = self.kept or ()
        out = []
        for sid, tp in zip(self.sample_ids, self.contexts, strict=True):
            if type(tp) is str and (tp[-1:] in _ODD_HEX or sid in kept) and (link := link_to(tp)) is not None:
                out.append(link)
        return out

    def record(self, i: int) -> _Record:
        """Member i's record, as a scored sample."""
        queue, compute = self.queue_s[i], self.compute_s
        return (self.sample_ids[i], self.pipeline, self.contexts[i], self.start_ns - int(queue * 1e9),  # type: ignore[return-value]
                self.scores[i], len(self.sample_ids), (queue + compute, queue, compute), "", self.number)  # fmt: skip


class _Recent:
    """The batches that served the last `capacity` to 2 x `capacity` samples, and which batch served each
    sample id, in two generations of plain dicts (the young one becomes the old one when full, the previous
    old one is dropped whole): one dict update per batch, nothing per sample."""

    __slots__ = ("_old", "_old_ids", "_young", "_young_ids", "_young_samples", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._young: dict[int, _Batch] = {}
        self._old: dict[int, _Batch] = {}
        self._young_ids: dict[str, int] = {}
        self._old_ids: dict[str, int] = {}
        self._young_samples = 0  # samples (not distinct ids: a client may reuse ids) in the young generation

    def add(self, batch: _Batch) -> None:
        self._young[batch.number] = batch
        ids = self._young_ids
        ids.update(dict.fromkeys(batch.sample_ids, batch.number))
        self._young_samples += len(batch.sample_ids)
        if self._young_samples >= self.capacity:
            self._old, self._old_ids = self._young, ids
            self._young, self._young_ids, self._young_samples = {}, {}, 0

    def find(self, sample_id: str) -> tuple[_Batch, int] | None:
        """The latest batch that served this sample id and its place in it, if still remembered."""
        number = self._young_ids.get(sample_id) or self._old_ids.get(sample_id)
        batch = (self._young.get(number) or self._old.get(number)) if number else None
        if batch is None:
            return None
        return batch, batch.sample_ids.index(sample_id)


# A kept sample's record: plain numbers and strings.
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
        batch_attrs: dict[str, AttributeValue] = {
            "rewardmesh.pipeline": batch.pipeline,
            "rewardmesh.batch.size": len(batch.sample_ids),
            "rewardmesh.batch.padded_tokens": batch.padded_tokens,
            "rewardmesh.batch.real_tokens": batch.real_tokens,
        }
        # Its own trace: a batch serves many samples, so it links to them rather than having a parent.
        out.append(rec.span("reward.batch", new_trace_id(), batch.span_id, None, batch.start_ns, batch.end_ns,
                            batch_attrs, links=batch.links()))  # fmt: skip
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
    """Hook points: `begin` when a sample arrives, `on_batch` (the engine's) when its batch ran, `on_failure` when
    it is answered with an error, `keep` when a KeepTraces names it."""

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
        self._recent = _Recent(trace_config().ring_size)  # for a later KeepTraces or a failure's batch span
        self._batch_no = 0
        # Kept samples' records waiting to become spans: (record, the batch whose span it exports, if any).
        self._deferred: deque[tuple[_Record, _Batch | None]] = deque()
        self._registered = False
        engine.batch_listeners.append(self.on_batch)
        _LIVE.add(self)

    @property
    def tracing(self) -> bool:
        return recorder() is not None

    def begin(self, trace_context: Mapping[str, str] | None) -> str | None:
        """A sample arrived with its own trace context: its traceparent (the batcher's context for it), if tracing."""
        if not trace_context or recorder() is None:
            return None
        return trace_context.get("traceparent")

    def on_batch(self, pipeline: str, info: BatchInfo) -> None:
        """A batch ran (before its samples are answered): its scored samples' metrics, and the batch kept as
        their record; the head-sampled ones' spans exported at once. Failed members are left to on_failure."""
        scores = [None if isinstance(o, BaseException) else o.score for o in info.outcomes]
        failed = None in scores
        if metrics_enabled():
            self.pending.add(self.batch_size, pipeline, info.size)
            queue, compute = info.queue_s, info.compute_s
            if failed:
                queue = [q for q, score in zip(queue, scores, strict=True) if score is not None]
            if queue:
                self.pending.add_columns(self.scored, self._timings, pipeline,
                                         ([q + compute for q in queue], queue, [compute] * len(queue)))  # fmt: skip
        if (rec := recorder()) is None:
            return
        self._batch_no += 1
        batch = _Batch(self._batch_no, pipeline, info, scores)
        self._recent.add(batch)
        for i, tp in enumerate(batch.contexts):
            if tp.__class__ is str and tp[-1] in _ODD_HEX and scores[i] is not None:
                batch.keep(batch.sample_ids[i])
                self._export(rec, batch.record(i), batch)

    def on_failure(self, result: reward_pb2.RewardResult, record: object, arrival_ns: int) -> None:
        """A failed sample: counted by kind, and its span exported at once (the decision is made here).
        `record`: what `begin` returned."""
        pipeline = result.reward
        if metrics_enabled():
            code = result.error.code
            counter = self.timed_out if code == _TIMED_OUT else self.rejected if code in _REJECTED else self.failed
            self.pending.count(counter, pipeline)
        if type(record) is not str or (rec := recorder()) is None:
            return
        sid = result.sample_id
        found = self._recent.find(sid)
        batch = found[0] if found is not None and found[0].contexts[found[1]] == record else None
        t = result.timing
        r: _Record = (sid, pipeline, record, arrival_ns, 0.0, result.batch_size, (t.total, t.queue, t.compute),
                      result.error.message or "failed", batch.number if batch is not None else 0)  # fmt: skip
        if batch is not None:
            batch.keep(sid)
        self._export(rec, r, batch)

    def _export(self, rec: FlightRecorder, r: _Record, batch: _Batch | None) -> int:
        """Queue a kept sample's spans (built in the recorder's builder thread); how many it will export."""
        owns_batch = batch is not None and not batch.span_id  # the first kept sample of a batch exports its span
        if owns_batch:
            batch.span_id = new_span_id()  # type: ignore[union-attr]
        deferred = self._deferred
        if not deferred and not self._registered:
            rec.add_source(self._drain)
            self._registered = True
        deferred.append((r, batch if owns_batch else None))
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
                r, batch = popleft()
            except IndexError:
                return out
            if rec is None:
                continue
            try:
                out += _spans(rec, r, batch)
            except Exception:  # telemetry must never cost a sample its result
                log.debug("could not build the spans of a kept sample", exc_info=True)

    def keep(self, sample_ids: Iterable[str]) -> tuple[int, int]:
        """Export the trees of these scored samples still remembered: (samples known, spans exported)."""
        rec = recorder()
        if rec is None:
            return 0, 0
        known: list[tuple[_Batch, int]] = []
        for sid in dict.fromkeys(sample_ids):
            found = self._recent.find(sid)
            if found is not None and found[0].scores[found[1]] is not None:
                known.append(found)
        fresh = [(b, i) for b, i in known if b.keep(b.sample_ids[i])]  # all marked first: a batch span links
        return len(known), sum(self._export(rec, b.record(i), b) for b, i in fresh)
