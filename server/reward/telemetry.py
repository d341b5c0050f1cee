"""Reward-side telemetry per pipeline: metrics for every sample, spans for the samples kept.

Scored samples cost telemetry nothing one by one: the batcher hands over each executed batch with every
sample's queue time and outcome (`BatchInfo`), and that batch is the record.

Metrics: `rewardmesh.reward.{latency,queue_time,compute_time,batch_size}` histograms,
`rewardmesh.reward.{scored,failed,rejected,timed_out}` counters, and the gauges an autoscaler reads, observed
at each collection: `rewardmesh.reward.queue_depth` (samples queued) and `rewardmesh.reward.queue_delay` (seconds
the longest-waiting queued sample has waited), per pipeline and tenant, and `rewardmesh.reward.in_flight` per
tenant (queued or computing). The histograms and counters are collected per batch as float arrays and
handed to the SDK in one call per instrument at each metric collection (`rewardmesh.common.batched_metrics`): exact
counts and bucket shape at a fraction of the per-sample cost. Latency is arrival to result (queue + compute).

Spans: each sample's reward.queue / reward.compute and its batch's reward.batch (linked to the samples it
served) are built only when the sample is kept: its traceparent says head-sampled, it failed here, or a
keep decision names it (a step's slowest, on the Score stream or a KeepTraces call). Until then the recent
batches, their members held compactly, and a ring of the members' id hashes are all that is kept.
"""

from __future__ import annotations

import logging
import math
import re
import weakref
from array import array
from collections.abc import Mapping, Sequence

import grpc
import numpy as np
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.util.types import AttributeValue

from rewardmesh.common.batched_metrics import SECONDS_BUCKETS, SIZE_BUCKETS, HistogramBatch
from rewardmesh.common.flight_recorder import (
    FlightRecorder,
    LinkTo,
    Ring,
    SpanBlock,
    SpanQueue,
    new_span_id,
    new_trace_id,
    parse_traceparent,
)
from rewardmesh.common.telemetry import meter, metrics_enabled, recorder, trace_config
from rewardmesh.reward_engine.batcher import BatchInfo
from rewardmesh.reward_engine.engine import RewardEngine
from rewardmesh.reward_engine.fair_queue import DEFAULT_TENANT, Tenant
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
_FAILED = math.nan  # a failed member's score (one object: `is` finds it)
_ODD_HEX = frozenset("13579bdfBDF")


_SEP = "\x1f"  # between a batch's member ids (or traceparents) in the one string that holds them
_TP_LEN = 55  # a version-00 traceparent: 00-<32 hex>-<16 hex>-<2 hex>
_EVEN_HEX = "02468aceACE"
_TRACEPARENTS = re.compile(r"(?:00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}\x1f)*00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_ZERO_TRACE, _ZERO_SPAN = "-" + "0" * 32 + "-", "-" + "0" * 16 + "-"  # an all-zero id is invalid


class _Batch:
    """One executed batch, as its span and its members' spans would show it (built only if one is kept).

    Its members are held compactly, in two strings and two float arrays, with no object per member: a ring of
    per-member strings and floats (32,768 samples' worth) cost the event loop about 1 us per sample, memory
    that is never reused while it is still in the cache. A kept member is found in the strings in place."""

    __slots__ = ("_hex", "_placeable", "_uniform", "compute_s", "contexts", "end_ns", "given", "head_kept", "ids",
                 "kept", "number", "padded_tokens", "pipeline", "queue_s", "real_tokens", "scores", "size", "span_id",
                 "start_ns")  # fmt: skip

    def __init__(self, number: int, pipeline: str, info: BatchInfo, scores: list[float]) -> None:
        self.number = number
        self.pipeline = pipeline
        self.size = len(info.sample_ids)
        self.ids = _SEP.join(info.sample_ids)
        ctx = info.contexts
        missing = ctx.count(None)
        # Traceparents: joined when every member came with one (an older sender's way), by member when some
        # did (the head-sampled: usually none or a few), None when none did.
        self.contexts: str | dict[int, str] | None = (
            None if missing == len(ctx) else _SEP.join(ctx) if not missing  # type: ignore[arg-type]
            else {i: c for i, c in enumerate(ctx) if type(c) is str})  # fmt: skip
        self.queue_s = array("d", info.queue_s)
        self.scores = array("d", scores)  # NaN: the member failed (its span is exported by on_failure)
        self.compute_s = info.compute_s
        self.start_ns, self.end_ns = info.start_time_ns, info.end_time_ns
        self.padded_tokens, self.real_tokens = info.padded_tokens, info.real_tokens
        self.head_kept = False  # its scored head-sampled members' spans are exported (or queued for export)
        self.kept: set[str] | None = None  # the members kept otherwise (failed, named by a keep decision)
        self.given: dict[str, str] | None = None  # traceparents of kept members that came without one
        self.span_id = 0  # set when exported (once)
        self._uniform: bool | None = None
        self._hex: bool | None = None
        self._placeable: bool | None = None  # no id holds the separator: members can be found in `ids`

    def index(self, sample_id: str) -> int | None:
        """The member with this id (the last, if twice), found in the joined ids (C-level searches, no split);
        None if absent, or if an id holds the separator (then no member can be placed)."""
        ids, n = self.ids, len(sample_id)
        if self._placeable is None:
            self._placeable = ids.count(_SEP) == self.size - 1
        if not n or not self._placeable:
            return None
        pos = ids.rfind(sample_id)
        while pos >= 0:
            end = pos + n
            if (pos == 0 or ids[pos - 1] == _SEP) and (end == len(ids) or ids[end] == _SEP):
                return ids.count(_SEP, 0, pos)
            pos = ids.rfind(sample_id, 0, end - 1)
        return None

    def uniform(self) -> bool:
        """Every member has a version-00 traceparent: member i's is a fixed slice of the joined string."""
        if self._uniform is None:
            joined, n = self.contexts, self.size
            self._uniform = (type(joined) is str and len(joined) == (_TP_LEN + 1) * n - 1
                             and joined[_TP_LEN :: _TP_LEN + 1] == _SEP * (n - 1))  # fmt: skip
        return self._uniform

    def hex_ids(self) -> bool:
        """Every member has a well-formed version-00 traceparent (checked for the whole batch in one match), so
        its ids can be written as the hex text they arrived as, without parsing them."""
        if self._hex is None:
            joined = self.contexts
            self._hex = (self.uniform() and _TRACEPARENTS.fullmatch(joined) is not None  # type: ignore[arg-type]
                         and _ZERO_TRACE not in joined and _ZERO_SPAN not in joined)  # type: ignore[operator]  # fmt: skip
        return self._hex

    def _by_member(self) -> dict[int, str]:
        """The traceparents by member (joined ones split out: once, and only for a batch that is kept)."""
        ctx = self.contexts
        if ctx is None:
            return {}
        if type(ctx) is str:
            parts = ctx.split(_SEP)
            self.contexts = ctx = {i: c for i, c in enumerate(parts) if c} if len(parts) == self.size else {}
            self._uniform = self._hex = False
        return ctx  # type: ignore[return-value]

    def context(self, i: int) -> str | None:
        """Member i's traceparent, if it came with one."""
        if self.contexts is None:
            return None
        if self.uniform():
            return self.contexts[i * (_TP_LEN + 1) : i * (_TP_LEN + 1) + _TP_LEN]  # type: ignore[index]
        return self._by_member().get(i)

    def sampled(self) -> list[int]:
        """Members whose traceparent says head-sampled: with uniform traceparents their flags' last digits are
        one C-level slice of the joined string, and almost no batch has an odd one."""
        if self.contexts is None:
            return []
        if self.uniform():
            flags = self.contexts[_TP_LEN - 1 :: _TP_LEN + 1]  # type: ignore[index]
            return [i for i, f in enumerate(flags) if f in _ODD_HEX] if flags.strip(_EVEN_HEX) else []
        return sorted(i for i, tp in self._by_member().items() if tp[-1] in _ODD_HEX)

    def keep(self, sample_id: str, i: int | None = None, traceparent: str = "") -> bool:
        """Mark member `sample_id` (at i, if known) kept, with the traceparent it came without, if given; False if
        it already was (by this or, scored and head-sampled, with the batch's head-sampled members)."""
        if self.head_kept and i is not None and self.scored(i) and (tp := self.context(i)) and tp[-1] in _ODD_HEX:
            return False
        if self.kept is None:
            self.kept = set()
        elif sample_id in self.kept:
            return False
        self.kept.add(sample_id)
        if traceparent:
            self.given = self.given or {}
            self.given[sample_id] = traceparent
        return True

    def scored(self, i: int) -> bool:
        return not math.isnan(self.scores[i])

    def links(self) -> list[LinkTo]:
        """Links to the served samples that are kept: a link to a span never exported says nothing."""
        sampled = self.sampled()
        if self.hex_ids():  # checked: the ids as the hex they came as
            links: list[LinkTo] = [(tp[3:35], tp[36:52], True) for tp in map(self.context, sampled)]  # type: ignore[index]
            contexts: list[str | None] = []
        else:
            links, contexts = [], [self.context(i) for i in sampled]
        if self.kept:  # the others, found by id (a head-sampled member that failed is among both)
            given, linked = self.given or {}, set(sampled)
            for sid in list(self.kept):  # a copy: the event loop may add to it while the builder thread reads
                if (i := self.index(sid)) is not None and i not in linked:
                    contexts.append(self.context(i) or given.get(sid))
        parsed = [p for tp in contexts if tp is not None and (p := parse_traceparent(tp)) is not None]
        return links + [(f"{t:032x}", f"{s:016x}", sampled) for t, s, sampled in parsed]

    def record(self, i: int, sample_id: str, traceparent: str = "") -> _Record:
        """Member i's record (its id is `sample_id`; `traceparent`: the one it came without), as a scored sample."""
        queue, compute = self.queue_s[i], self.compute_s
        return (sample_id, self.pipeline, self.context(i) or traceparent, self.start_ns - int(queue * 1e9),
                self.scores[i], self.size, (queue + compute, queue, compute), "", self.number)  # fmt: skip


class _Recent:
    """The batches that served the last `capacity` samples, and which batch served each sample id: a ring of
    the ids' hashes and their batch numbers in two integer arrays (no object per sample). A keep decision
    names a step's slowest, so the newest batches are searched first, in place; then the ring, in one
    vectorized comparison."""

    __slots__ = ("_batches", "_hashes", "_numbers", "_pos", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._hashes = np.zeros(self.capacity, dtype=np.int64)
        self._numbers = np.zeros(self.capacity, dtype=np.int64)  # 0: an empty slot
        self._pos = 0  # the next slot to write: the oldest entry once the ring is full
        self._batches: dict[int, _Batch] = {}  # by number, oldest first

    def add(self, batch: _Batch, sample_ids: list[str]) -> None:
        cap, n = self.capacity, len(sample_ids)
        hashes = np.fromiter(map(hash, sample_ids[-cap:]), dtype=np.int64, count=min(n, cap))
        pos, k = self._pos, len(hashes)
        first = min(k, cap - pos)  # up to the end of the ring, then from its start
        self._hashes[pos : pos + first] = hashes[:first]
        self._numbers[pos : pos + first] = batch.number
        self._hashes[: k - first] = hashes[first:]
        self._numbers[: k - first] = batch.number
        self._pos = (pos + k) % cap
        batches = self._batches
        batches[batch.number] = batch
        oldest = int(self._numbers[self._pos])  # the oldest batch with a member still in the ring (0: not full)
        while oldest:
            number = next(iter(batches))
            if number >= oldest:
                break
            del batches[number]

    def find(self, sample_id: str) -> tuple[_Batch, int] | None:
        """The latest batch that served this sample id and its place in it, if still remembered."""
        batches, searched = self._batches, 0
        for number in reversed(batches):  # the newest ~2,048 samples' batches, in place
            if searched >= _NEWEST_SAMPLES:
                break
            batch = batches[number]
            if (i := batch.index(sample_id)) is not None:
                return batch, i
            searched += batch.size
        slots = np.flatnonzero(self._hashes == hash(sample_id))
        for slot in sorted(slots.tolist(), key=lambda s: (self._pos - 1 - s) % self.capacity):  # newest first
            batch = batches.get(int(self._numbers[slot]))  # type: ignore[assignment]
            if batch is not None and (i := batch.index(sample_id)) is not None:
                return batch, i
        return None


_NEWEST_SAMPLES = 2048


# A kept sample's record: plain numbers and strings.
_Record = tuple[str, str, str, int, float, int, tuple[float, float, float], str, int]
# (sample id, pipeline, traceparent, arrival ns, score, batch size, (total, queue, compute) s, error, batch no)
_Entry = _Record | tuple[_Batch, list[str], list[int]]  # a queued kept sample, or a batch's head-sampled members


def _sample_spans(out: list[SpanBlock], traces: list[str], parents: list[str], sample_ids: list[str], pipeline: str,
                  batch_size: int, arrivals: list[int], queue_s: Sequence[float], compute_s: Sequence[float],
                  scores: Sequence[float]) -> None:  # fmt: skip
    """Kept scored samples' reward.queue and reward.compute spans (a block each), under their reward spans
    (`parents`, in traces `traces`), sample i arriving at arrivals[i], queued queue_s[i], computed compute_s[i]."""
    shared: dict[str, AttributeValue] = {"rewardmesh.pipeline": pipeline, "rewardmesh.batch.size": batch_size}
    queue_ends = [t0 + int(q * 1e9) for t0, q in zip(arrivals, queue_s, strict=True)]
    compute_ends = [t + int(c * 1e9) for t, c in zip(queue_ends, compute_s, strict=True)]
    ids = {"rewardmesh.sample_id": sample_ids}
    out.append(SpanBlock("reward.queue", traces, [new_span_id() for _ in traces], parents, arrivals, queue_ends,
                         shared, ids))  # fmt: skip
    out.append(SpanBlock("reward.compute", traces, [new_span_id() for _ in traces], parents, queue_ends, compute_ends,
                         shared, {**ids, "rewardmesh.score": scores}))  # fmt: skip


def _batch_spans(out: list[SpanBlock], batches: list[_Batch]) -> None:
    """The batches' spans, each in its own trace (a batch serves many samples, so it links to them rather than
    having a parent); their ids were drawn when each batch's first kept member was queued."""
    out.append(SpanBlock("reward.batch", [f"{new_trace_id():032x}" for _ in batches], [b.span_id for b in batches],
                         None, [b.start_ns for b in batches], [max(b.end_ns, b.start_ns) for b in batches], {},
                         {"rewardmesh.pipeline": [b.pipeline for b in batches],
                          "rewardmesh.batch.size": [b.size for b in batches],
                          "rewardmesh.batch.padded_tokens": [b.padded_tokens for b in batches],
                          "rewardmesh.batch.real_tokens": [b.real_tokens for b in batches]},
                         links=[b.links() for b in batches]))  # fmt: skip


def _record_spans(out: list[SpanBlock], records: list[_Record]) -> None:
    """The spans of kept samples' records (failures, members named by a keep decision): the scored ones' in one
    block pair per pipeline and batch size (so a drain's keep decisions cost a few blocks, not a few per sample)."""
    scored: dict[tuple[str, int], list[tuple[str, str, _Record]]] = {}
    for r in records:
        sid, pipeline, tp, t0, _, batch_size, timing, error, _ = r
        parsed = parse_traceparent(tp)
        if parsed is None:
            continue
        trace, parent = f"{parsed[0]:032x}", f"{parsed[1]:016x}"
        if not error:
            scored.setdefault((pipeline, batch_size), []).append((trace, parent, r))
            continue
        attrs: dict[str, AttributeValue] = {"rewardmesh.sample_id": sid, "rewardmesh.pipeline": pipeline,
                                            "rewardmesh.batch.size": batch_size}  # fmt: skip
        out.append(SpanBlock("reward.queue", [trace], [new_span_id()], [parent], [t0], [t0 + int(timing[0] * 1e9)],
                             attrs, errors=[error]))  # fmt: skip
    for (pipeline, batch_size), group in scored.items():
        rs = [r for _, _, r in group]
        _sample_spans(out, [t for t, _, _ in group], [p for _, p, _ in group], [r[0] for r in rs], pipeline,
                      batch_size, [r[3] for r in rs], [r[6][1] for r in rs], [r[6][2] for r in rs],
                      [r[4] for r in rs])  # fmt: skip


def _head_sampled_spans(out: list[SpanBlock], batch: _Batch, sample_ids: list[str], members: list[int]) -> None:
    """The spans of a batch's scored head-sampled members, straight from the batch, a column at a time. Where every
    member's traceparent is well formed (one check for the batch), the ids are slices of the string they came in."""
    if batch.hex_ids():
        contexts: list[str] = [batch.context(i) for i in members]  # type: ignore[misc]
        traces = [tp[3:35] for tp in contexts]
        parents = [tp[36:52] for tp in contexts]
    else:
        kept, traces, parents = [], [], []
        for i in members:
            if (tp := batch.context(i)) is not None and (parsed := parse_traceparent(tp)) is not None:
                kept.append(i)
                traces.append(f"{parsed[0]:032x}")
                parents.append(f"{parsed[1]:016x}")
        members = kept
    queue_s, start, compute = batch.queue_s, batch.start_ns, batch.compute_s
    queues = [queue_s[i] for i in members]
    scores = batch.scores
    _sample_spans(out, traces, parents, [sample_ids[i] for i in members], batch.pipeline, batch.size,
                  [start - int(q * 1e9) for q in queues], queues, [compute] * len(members),
                  [scores[i] for i in members])  # fmt: skip


_LIVE: weakref.WeakSet[RewardTelemetry] = weakref.WeakSet()


def _observe_all(options: CallbackOptions) -> list[Observation]:
    """Runs at every collection: first hand over what the hot paths collected, so the collection includes it."""
    out = []
    for t in list(_LIVE):
        t.pending.flush()
        for name, depth, _ in t.queues():
            out.append(Observation(depth, {"pipeline": name[0], "tenant": name[1]}))
    return out


def _observe_delays(options: CallbackOptions) -> list[Observation]:
    queues = [q for t in list(_LIVE) for q in t.queues()]
    return [Observation(delay, {"pipeline": pipeline, "tenant": tenant}) for (pipeline, tenant), _, delay in queues]


def _observe_in_flight(options: CallbackOptions) -> list[Observation]:
    return [Observation(tenant.in_flight, {"tenant": tenant.name}) for t in list(_LIVE) for tenant in t.tenants]


class RewardTelemetry:
    """Hook points: `begin` when a sample arrives, `on_batch` (the engine's) when its batch ran, `on_failure` when
    it is answered with an error, `keep` when a KeepTraces names it."""

    def __init__(self, engine: RewardEngine, tenants: Sequence[Tenant] = (DEFAULT_TENANT,)) -> None:
        self.engine = engine
        self.tenants = list(tenants)  # the server's tenants, the first the default (for per-tenant gauges)
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
        m.create_observable_gauge(
            "rewardmesh.reward.queue_delay",
            [_observe_delays],
            unit="s",
            description="how long the longest-waiting queued sample has waited",
        )
        m.create_observable_gauge(
            "rewardmesh.reward.in_flight", [_observe_in_flight], unit="{sample}", description="queued or computing"
        )
        self._timings = (self.latency, self.queue_time, self.compute_time)
        self.pending = HistogramBatch()
        self._recent = _Recent(trace_config().ring_size)  # for a later KeepTraces or a failure's batch span
        self._failures = Ring(4096)  # failed samples that came without a traceparent: (record, batch) until kept
        self._failed_in = Ring(4096)  # sample id -> the batch it failed in, until on_failure takes it
        self._batch_no = 0
        # Kept samples waiting to become spans: (a record, or a batch's head-sampled members; the batch whose span
        # goes with them, if any).
        self._deferred: SpanQueue | None = None  # made, and registered with the recorder, at the first kept sample
        engine.batch_listeners.append(self.on_batch)
        _LIVE.add(self)

    def queues(self) -> list[tuple[tuple[str, str], int, float]]:
        """((pipeline, tenant), samples queued, seconds the longest-waiting one has waited), for every tenant
        that has queued on each pipeline, and the default tenant (zeros until it queues)."""
        out: dict[tuple[str, str], tuple[int, float]] = {}
        default = self.tenants[0].name if self.tenants else DEFAULT_TENANT.name
        for name, pipeline in self.engine.pipelines.items():
            out[(name, default)] = (0, 0.0)
            for tenant, depth, delay in pipeline.batcher.tenant_queues():  # one series per name: the gateway's
                was = out.get((name, tenant.name), (0, 0.0))  # default tenant and the table's are one to a reader
                out[(name, tenant.name)] = (was[0] + depth, max(was[1], delay))
        return [(key, depth, delay) for key, (depth, delay) in out.items()]

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
        try:
            scores = [o.score for o in info.outcomes]  # type: ignore[union-attr]  # every member scored: most batches
            failed = False
        except AttributeError:
            scores = [_FAILED if isinstance(o, BaseException) else o.score for o in info.outcomes]
            failed = True
        if metrics_enabled():
            self.pending.add(self.batch_size, pipeline, info.size)
            queue = info.queue_s
            if failed:
                queue = [q for q, score in zip(queue, scores, strict=True) if score is not _FAILED]
            if queue:
                self.pending.add_timings(self.scored, self._timings, pipeline, queue, info.compute_s)
        if (rec := recorder()) is None:
            return
        self._batch_no += 1
        batch = _Batch(self._batch_no, pipeline, info, scores)
        self._recent.add(batch, info.sample_ids)
        if failed:  # on_failure finds their batch here, not by a search: rejections come in storms
            for sid, score in zip(info.sample_ids, scores, strict=True):
                if score is _FAILED:
                    self._failed_in.put(sid, batch)
        sampled = batch.sampled()
        if sampled:  # queued as one entry: its spans are built off the event loop
            members = [i for i in sampled if batch.scored(i)] if failed else sampled
            batch.head_kept = True
            if members:
                self._queue(rec, (batch, info.sample_ids, members), 2 * len(members), batch)

    def on_failure(self, result: reward_pb2.RewardResult, record: object, arrival_ns: int) -> None:
        """A failed sample: counted by kind, and its span exported at once if it came with its traceparent, else
        remembered until a keep decision brings one (its sender decides). `record`: what `begin` returned."""
        pipeline = result.reward
        if metrics_enabled():
            code = result.error.code
            counter = self.timed_out if code == _TIMED_OUT else self.rejected if code in _REJECTED else self.failed
            self.pending.count(counter, pipeline)
        if (rec := recorder()) is None:
            return
        sid = result.sample_id
        batch: _Batch | None = self._failed_in.pop(sid)  # the batch it failed in, if it failed in one
        t = result.timing
        tp = record if type(record) is str else ""
        r: _Record = (sid, pipeline, tp, arrival_ns, 0.0, result.batch_size, (t.total, t.queue, t.compute),
                      result.error.message or "failed", batch.number if batch else 0)  # fmt: skip
        if not tp:
            self._failures.put(sid, (r, batch))
            return
        if batch is not None:
            batch.keep(sid)
        self._queue(rec, r, 1, batch)

    def _queue(self, rec: FlightRecorder, entry: _Entry, spans: int, batch: _Batch | None) -> int:
        """Queue kept samples' spans (`spans` of them; built in the recorder's builder thread) and, with the first
        kept member of `batch`, the batch's span; how many will be exported (0: dropped, the builder is behind)."""
        owns_batch = batch is not None and not batch.span_id
        if owns_batch:  # drawn before it is queued: the builder may take it at once
            batch.span_id = new_span_id()  # type: ignore[union-attr]
        if self._deferred is None:
            self._deferred = SpanQueue(rec)
            rec.add_source(self._drain)
        if not self._deferred.put((entry, batch if owns_batch else None), spans + owns_batch):
            if owns_batch:
                batch.span_id = 0  # type: ignore[union-attr]  # a later kept member exports it
            return 0
        return spans + owns_batch

    def _drain(self) -> list[SpanBlock]:
        """The spans of the kept samples queued so far (the builder thread's call)."""
        out: list[SpanBlock] = []
        records: list[_Record] = []
        batches: list[_Batch] = []
        for entry, batch in self._deferred.take() if self._deferred is not None else ():
            if batch is not None:
                batches.append(batch)
            if len(entry) != 3:
                records.append(entry)
                continue
            try:  # a batch's head-sampled members
                _head_sampled_spans(out, *entry)
            except Exception:  # telemetry must never cost a sample its result
                log.debug("could not build the spans of a batch's head-sampled samples", exc_info=True)
        try:
            _record_spans(out, records)
            if batches:
                _batch_spans(out, batches)
        except Exception:
            log.debug("could not build the spans of kept samples", exc_info=True)
        return out

    def keep(self, kept: Mapping[str, str]) -> tuple[int, int]:
        """Export the trees of these samples still remembered: sample id -> its traceparent, for one sent without
        ("": the one it came with). Returns (samples known, spans exported)."""
        rec = recorder()
        if rec is None:
            return 0, 0
        known = 0
        records: list[tuple[_Record, _Batch | None]] = []
        for sid, given in kept.items():
            found = self._recent.find(sid)
            if found is not None and found[0].scored(found[1]):
                known += 1
                batch, i = found
                if batch.keep(sid, i, given):  # all marked before any is built: a batch span links every kept one
                    records.append((batch.record(i, sid, given), batch))
            elif (failure := self._failures.get(sid)) is not None:
                known += 1
                r, batch = failure
                if given and not r[2]:  # a failure that came without its traceparent: exported now, once
                    self._failures.put(sid, ())
                    if batch is not None:
                        batch.keep(sid, None, given)
                    records.append(((*r[:2], given, *r[3:]), batch))
        return known, sum(self._queue(rec, r, 1 if r[7] else 2, b) for r, b in records)
