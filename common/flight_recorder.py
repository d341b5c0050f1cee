"""Flight recorder: every sample's timeline in a bounded ring; span trees built only for the samples kept.

Building and exporting an SDK span costs far more Python than the work a cheap reward rule does, so the
hot path records plain tuples (phase, start, end, ids) and nothing else. A sample's spans are materialized
(with their real start and end times and ids agreed when the sample started) only when the sample is kept:
head-sampled (the trace flags), failed (decided where it failed), or named later by a `KeepTraces` call (a
step's slowest samples, decided by the trainer when the step ends). Each process exports its own part under
its own resource; ids travel in the W3C traceparent as before.

Kept spans are not SDK spans either: they are `SpanBlock`s, spans of one name column by column (a kept batch's
members' reward.queue spans are one block). The recorder's builder thread hands blocks in bursts straight to the
exporters (no span processor in between: the burst is the batch), and an exporter that writes blocks itself
(a `BlockExporter`, as the OTLP JSON lines exporter is) never sees a span object. Other exporters and span
processors get the `ReadableSpan`s of the blocks, as before.
"""

from __future__ import annotations

import gc
import logging
import random
import threading
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import DEFAULT_TRACE_STATE
from opentelemetry.util.types import AttributeValue

log = logging.getLogger(__name__)

_SCOPE = InstrumentationScope("rewardmesh")
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_OK = Status(StatusCode.UNSET)
_getrandbits = random.getrandbits
_NO_STATE = DEFAULT_TRACE_STATE
_object_new = object.__new__
_tuple_new = tuple.__new__

Attributes = Mapping[str, AttributeValue]
LinkTo = tuple[str, str, bool]  # (trace id, span id, sampled) of the linked span, ids in hex


@dataclass(slots=True, eq=False)
class SpanBlock:
    """Finished spans of one name and kind, column by column (span i is the i-th of every column). Ids are text:
    32 and 16 lowercase hex digits, as a checked traceparent brings them, so a kept batch's spans are slices of
    the string its members' traceparents came in and an exporter writing text copies them. A block of a batch's
    members costs a few list comprehensions to build; an exporter writing text formats it in one more."""

    name: str
    trace_ids: Sequence[str]
    span_ids: Sequence[int]
    parent_ids: Sequence[str] | None  # None: every span is a root
    starts: Sequence[int]  # ns since the epoch
    ends: Sequence[int]  # each at or after its start (the builder of a block sees to it)
    attributes: Attributes  # every span's
    columns: Mapping[str, Sequence[AttributeValue]] = field(default_factory=dict)  # an attribute per span
    errors: Sequence[str | None] | None = None  # a span's error message (None: every span is fine)
    links: Sequence[Sequence[LinkTo]] | None = None
    kind: SpanKind = SpanKind.INTERNAL

    def __len__(self) -> int:
        return len(self.span_ids)

    def spans(self, resource: Resource) -> list[ReadableSpan]:
        """The SDK spans, for exporters and processors that take span objects."""
        out = []
        keys = list(self.columns)
        for i, (trace_hex, span_id, start, end) in enumerate(zip(self.trace_ids, self.span_ids, self.starts, self.ends,
                                                                 strict=True)):  # fmt: skip
            trace_id = int(trace_hex, 16)
            attrs = dict(self.attributes)
            for k in keys:
                attrs[k] = self.columns[k][i]
            error = self.errors[i] if self.errors is not None else None
            links = self.links[i] if self.links is not None else ()
            out.append(_readable_span(
                self.name,
                _context(trace_id, span_id),
                _context(trace_id, int(self.parent_ids[i], 16)) if self.parent_ids is not None else None,
                resource,
                attrs,
                [Link(SpanContext(int(t, 16), int(s, 16), True, TraceFlags(int(sampled)))) for t, s, sampled in links],
                self.kind,
                _OK if error is None else Status(StatusCode.ERROR, error),
                start,
                end,
            ))  # fmt: skip
        return out


class BlockExporter(SpanExporter):
    """A span exporter that writes the recorder's blocks itself (`export_blocks`): kept spans reach it as blocks,
    never as span objects; SDK spans (steps, RPCs) still come through `export`."""

    def export_blocks(self, resource: Resource, blocks: Sequence[SpanBlock]) -> SpanExportResult:
        raise NotImplementedError


def merge_singles(blocks: list[SpanBlock]) -> list[SpanBlock]:
    """Blocks of one span each merged into one block per name, kind and attribute keys (the attributes become
    columns), so that many small trees (a rollout server's kept samples) cost what one batch's spans do to write.
    Other blocks pass through; the spans' order across names is not kept."""
    out: list[SpanBlock] = []
    groups: dict[tuple[Any, ...], list[SpanBlock]] = {}
    for b in blocks:
        if len(b.span_ids) != 1 or b.columns or b.links:
            out.append(b)
        else:
            groups.setdefault((b.name, b.kind, b.parent_ids is None, *b.attributes), []).append(b)
    for group in groups.values():
        first = group[0]
        if len(group) == 1:
            out.append(first)
            continue
        errors = [b.errors[0] if b.errors is not None else None for b in group]
        out.append(SpanBlock(
            first.name,
            [b.trace_ids[0] for b in group],
            [b.span_ids[0] for b in group],
            None if first.parent_ids is None else [b.parent_ids[0] for b in group],  # type: ignore[index]
            [b.starts[0] for b in group],
            [b.ends[0] for b in group],
            {},
            {k: [b.attributes[k] for b in group] for k in first.attributes},
            errors=errors if any(e is not None for e in errors) else None,
            kind=first.kind,
        ))  # fmt: skip
    return out


def _context(trace_id: int, span_id: int) -> SpanContext:
    """`SpanContext(trace_id, span_id, False, SAMPLED)` without the constructor's checks (the ids are valid:
    drawn here or parsed from a checked traceparent)."""
    return _tuple_new(SpanContext, (trace_id, span_id, False, _SAMPLED, _NO_STATE, True))


_SPAN_FIELDS = ReadableSpan("probe").__dict__.keys()
# This SDK's ReadableSpan holds exactly these fields: spans are built (and read, see otlp_json.span_json) by them.
FAST_SPANS = set(_SPAN_FIELDS) == {
    "_name", "_context", "_kind", "_instrumentation_info", "_instrumentation_scope", "_parent", "_start_time",
    "_end_time", "_attributes", "_events", "_links", "_resource", "_status",
}  # fmt: skip


def _readable_span(
    name: str,
    context: SpanContext,
    parent: SpanContext | None,
    resource: Resource,
    attributes: Attributes,
    links: Sequence[Link],
    kind: SpanKind,
    status: Status,
    start_ns: int,
    end_ns: int,
) -> ReadableSpan:
    """A ReadableSpan with its fields set in one dict (half its constructor's cost); the constructor itself
    if this SDK's ReadableSpan has other fields than the ones known here."""
    if not FAST_SPANS:  # pragma: no cover
        return ReadableSpan(name, context, parent, resource, attributes, links=links, kind=kind, status=status,
                            start_time=start_ns, end_time=end_ns, instrumentation_scope=_SCOPE)  # fmt: skip
    span = _object_new(ReadableSpan)
    span.__dict__ = {
        "_name": name,
        "_context": context,
        "_kind": kind,
        "_instrumentation_info": None,
        "_instrumentation_scope": _SCOPE,
        "_parent": parent,
        "_start_time": start_ns,
        "_end_time": end_ns,
        "_attributes": attributes,
        "_events": (),
        "_links": links,
        "_resource": resource,
        "_status": status,
    }
    return span


def new_span_id() -> int:
    return _getrandbits(64) or 1


def new_trace_id() -> int:
    return _getrandbits(128) or 1


def traceparent(trace_id: int, span_id: int, sampled: bool) -> str:
    """The W3C traceparent header value for these ids."""
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


def parse_traceparent(value: str) -> tuple[int, int, bool] | None:
    """(trace id, span id, sampled) of a W3C traceparent, None when it is not one."""
    if len(value) == 55 and value[2] == value[35] == value[52] == "-":  # version 00: the fixed layout
        try:
            trace_id, span_id, flags = int(value[3:35], 16), int(value[36:52], 16), int(value[53:55], 16)
        except ValueError:
            return None
        return (trace_id, span_id, bool(flags & 1)) if trace_id and span_id else None
    parts = value.split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3][:2], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(flags & 1)


DEFERRED_TICK_S = 0.2  # the longest a kept record waits to become spans
EXPORT_BATCH = 512  # spans per export call (BatchSpanProcessor's default export batch size)
MAX_QUEUED_SPANS = 1 << 16  # per queue, waiting for the builder thread; beyond it kept spans are dropped (counted)


class _DeferredFlush(SpanProcessor):
    def __init__(self, recorder: FlightRecorder) -> None:
        self.recorder = recorder

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self.recorder.flush_deferred(export_all=True)
        return True

    def shutdown(self) -> None:
        self.recorder.stop()


class Ring:
    """The last `capacity` to 2 x `capacity` records by key, in two generations of plain dicts.

    `put` is one dict store and a length check (no per-record bookkeeping, no ordered dict): when the young
    generation is full it becomes the old one and the previous old one is dropped whole. Records that are
    tuples of numbers and strings stay out of the garbage collector's way (it untracks them), so a full ring
    costs no collection time.
    """

    __slots__ = ("_old", "_young", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._young: dict[Hashable, Any] = {}
        self._old: dict[Hashable, Any] = {}

    def put(self, key: Hashable, record: Any) -> None:
        young = self._young
        young[key] = record
        if len(young) >= self.capacity:
            self._old, self._young = young, {}

    def get(self, key: Hashable) -> Any:
        r = self._young.get(key)
        return self._old.get(key) if r is None else r

    def pop(self, key: Hashable) -> Any:
        r = self._young.pop(key, None)
        return self._old.pop(key, None) if r is None else r

    def __len__(self) -> int:
        return len(self._young) + len(self._old)


class SpanQueue:
    """Kept samples waiting for the recorder's builder thread, bounded in spans (a stalled exporter costs dropped
    spans, counted, not memory): `put` on the owner's thread, `take` on the builder's. Each counter is written by
    one thread only, so none needs a lock."""

    def __init__(self, recorder: FlightRecorder) -> None:
        self.recorder = recorder
        self._items: deque[Any] = deque()
        self._put = self._taken = 0  # spans put in and taken out, ever
        self._unannounced = 0  # spans put in since the builder was last woken

    def put(self, item: Any, spans: int) -> bool:
        """Queue `item` (worth `spans` spans); False, and the spans counted as dropped, if the queue is full."""
        if self._put - self._taken + spans > MAX_QUEUED_SPANS:
            self.recorder.dropped_spans += spans
            return False
        self._items.append((item, spans))
        self._put += spans
        self._unannounced += spans
        if self._unannounced >= EXPORT_BATCH:  # a burst's worth: build now rather than at the next tick
            self._unannounced = 0
            self.recorder.wake()
        return True

    def take(self) -> list[Any]:
        """Everything queued so far, oldest first."""
        out, taken, popleft = [], 0, self._items.popleft
        while True:
            try:
                item, spans = popleft()
            except IndexError:
                break
            out.append(item)
            taken += spans
        self._taken += taken
        return out


class FlightRecorder:
    """Per-sample records (whatever the caller records) in a bounded ring, and the export of kept spans.

    `remember` costs a dict insert; the oldest records fall out after `capacity` newer ones, so a keep
    decision must come within the last `capacity` samples (a step or two at the default). Kept trees are
    queued (`export_tree`) and exported by the builder thread; an owner with a hot path of its own (the reward
    server's batches) keeps its own queue of records and registers its `drain` with `add_source`.
    """

    def __init__(
        self,
        resource: Resource,
        capacity: int = 32768,
        exporters: Sequence[SpanExporter] = (),
        processors: Sequence[SpanProcessor] = (),
    ) -> None:
        self.resource = resource
        self.capacity = max(1, capacity)
        self.exporters = list(exporters)  # kept spans go straight to these, in bursts
        self.processors = list(processors)  # and, as spans, to these (on_end), e.g. a test's in-memory exporter
        # Used from the event loop's thread only (the hot path and the KeepTraces handlers), so no lock.
        self._ring = Ring(self.capacity)
        self.exported_spans = 0
        self.dropped_spans = 0  # kept spans refused because the builder fell MAX_QUEUED_SPANS behind
        self._queued = SpanQueue(self)  # export_tree's trees, for the builder thread
        # Deferred building: owners queue kept records (plain tuples) and this recorder's builder thread
        # turns them into blocks in bursts, off the event loop, each burst exported as soon as it is built.
        self._sources: list[weakref.WeakMethod[Callable[[], list[SpanBlock]]]] = [
            weakref.WeakMethod(self._drain_queued)
        ]
        self._wake = threading.Event()
        self._build_lock = threading.Lock()
        self._builder: threading.Thread | None = None
        self._stopped = False

    def add_source(self, drain: Callable[[], list[SpanBlock]]) -> None:
        """Register an owner's `drain` (a bound method: the spans of the records it queued since the last call);
        it is called from the builder thread, and from `flush_deferred` (force_flush, shutdown)."""
        with self._build_lock:
            self._sources.append(weakref.WeakMethod(drain))
        self._start_builder()

    def _start_builder(self) -> None:
        with self._build_lock:
            if self._builder is None:
                self._builder = threading.Thread(target=self._build_loop, name="rewardmesh-span-builder", daemon=True)
                self._builder.start()

    def wake(self) -> None:
        """An owner's queue is long: build now rather than at the next tick."""
        self._wake.set()

    def _build_loop(self) -> None:
        while not self._stopped:
            self._wake.wait(DEFERRED_TICK_S)
            self._wake.clear()
            self.flush_deferred()

    def flush_deferred(self, export_all: bool = False) -> int:
        """Build and export what the owners queued; `export_all` (provider flush, shutdown) also flushes the span
        processors.

        The cyclic garbage collector is paused for a burst: its spans are built, exported and freed before any
        collection sees them. Otherwise collections during the burst promote thousands of short-lived objects to
        the old generation, and the full collections that follow cost more than building the spans.
        """
        with self._build_lock:
            paused = gc.isenabled()
            if paused:
                gc.disable()
            try:
                blocks: list[SpanBlock] = []
                live = []
                for ref in self._sources:
                    drain = ref()
                    if drain is None:
                        continue
                    live.append(ref)
                    try:
                        blocks += drain()
                    except Exception:  # telemetry must never fail the process
                        log.debug("could not build deferred spans", exc_info=True)
                self._sources = live
                n = chunk = start = 0
                for i, block in enumerate(blocks):  # export calls of about EXPORT_BATCH spans
                    chunk += len(block)
                    if chunk >= EXPORT_BATCH or i == len(blocks) - 1:
                        self._export(blocks[start : i + 1])
                        n, chunk, start = n + chunk, 0, i + 1
                if self.processors and (export_all or n >= EXPORT_BATCH):
                    for p in self.processors:
                        try:
                            p.force_flush()
                        except Exception:
                            log.debug("span processor flush failed", exc_info=True)
                del blocks
            finally:
                if paused:
                    gc.enable()
            return n

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self.flush_deferred(export_all=True)

    def flusher(self) -> SpanProcessor:
        """A span processor to install ahead of the exporting ones: a provider's force_flush / shutdown first
        exports what is deferred, so it is in the same flush."""
        return _DeferredFlush(self)

    def remember(self, key: Hashable, record: Any) -> None:
        """Keep `record` under `key` (owners in one process, e.g. an in-process mesh, use distinct keys)."""
        self._ring.put(key, record)

    def recall(self, keys: Iterable[Hashable]) -> list[Any]:
        """The records still in the ring for these keys (unknown or evicted keys are skipped)."""
        get = self._ring.get
        return [r for k in keys if (r := get(k)) is not None]

    def __len__(self) -> int:
        return len(self._ring)

    def span(
        self,
        name: str,
        trace_id: int,
        span_id: int,
        parent_id: int | None,
        start_ns: int,
        end_ns: int,
        attributes: Attributes | None = None,
        *,
        error: str | None = None,
    ) -> SpanBlock:
        """One finished span with exactly these ids and times (nothing is sampled or exported here)."""
        return SpanBlock(name, [f"{trace_id:032x}"], [span_id], [f"{parent_id:016x}"] if parent_id else None,
                         [start_ns], [max(end_ns, start_ns)], attributes or {},
                         errors=None if error is None else [error])  # fmt: skip

    def export_tree(self, record: Any) -> int:
        """Queue a kept record's spans (`record.spans(self)`: cheap to build here) for the builder thread; how
        many. Never raises: telemetry must not cost a sample its result."""
        try:
            blocks: list[SpanBlock] = record.spans(self)
        except Exception:
            log.debug("could not build the spans of a kept sample", exc_info=True)
            return 0
        n = sum(map(len, blocks))
        if not self._queued.put(blocks, n):
            return 0
        if self._builder is None:
            self._start_builder()
        return n

    def _drain_queued(self) -> list[SpanBlock]:
        return merge_singles([block for blocks in self._queued.take() for block in blocks])

    def _export(self, blocks: Sequence[SpanBlock]) -> None:
        """Hand finished spans to the exporters (blocks where they take them, span objects otherwise) and the
        span processors."""
        spans: list[ReadableSpan] | None = None
        for exporter in self.exporters:
            try:
                if isinstance(exporter, BlockExporter):
                    exporter.export_blocks(self.resource, blocks)
                    continue
                if spans is None:
                    spans = [s for b in blocks for s in b.spans(self.resource)]
                exporter.export(spans)
            except Exception:  # an exporter's failure must never fail a sample
                log.debug("span exporter %s failed", type(exporter).__name__, exc_info=True)
        if self.processors:
            if spans is None:
                spans = [s for b in blocks for s in b.spans(self.resource)]
            for span in spans:
                for p in self.processors:
                    try:
                        p.on_end(span)
                    except Exception:
                        log.debug("span processor failed on %s", span.name, exc_info=True)
        self.exported_spans += sum(map(len, blocks))
