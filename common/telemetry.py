"""OpenTelemetry for every rewardmesh process, configured by the standard OTEL_* environment variables.

Nothing is exported unless asked for: with OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER unset (or
"none") the API's no-op providers stay in place and a span costs a function call. Exporters:
`otlp` (needs the `rewardmesh[otlp]` extra), `console`, and `prometheus` for metrics (a scrape
endpoint, `rewardmesh[prometheus]`). Resource attributes: service name (OTEL_SERVICE_NAME, else
rewardmesh-<role>), role, host, pod.

Per-sample spans are not built in the hot path: each process keeps its samples' timelines in a flight
recorder (`rewardmesh.common.flight_recorder`) and exports a sample's spans only when the sample is kept: head-sampled
(a random fraction of prompt groups, decided by the trainer and carried in the trace flags:
OTEL_TRACES_SAMPLER=traceidratio / parentbased_traceidratio with OTEL_TRACES_SAMPLER_ARG, always_on = every
sample, always_off = none; unset: DEFAULT_HEAD_RATIO), failed, or among its step's slowest
(REWARDMESH_TRACE_KEEP_SLOWEST, default 4, announced by the trainer with KeepTraces, which rollout servers pass
on to their reward targets on the Score stream). Step and RPC spans are ordinary SDK spans; a step span is
always recorded, so the kept trees of a step hang under it.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, propagate, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult, SpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

from rewardmesh.common import batched_metrics
from rewardmesh.common.flight_recorder import FAST_SPANS, FlightRecorder, SpanBlock

log = logging.getLogger(__name__)

TRACER_NAME = "rewardmesh"
DEFAULT_HEAD_RATIO = 0.01
# tracestate key carrying the step span's id, so a kept sample of an unsampled group hangs under its step.
STEP_KEY = "rewardmesh"


@dataclass
class TraceConfig:
    """Which samples' span trees are exported (the rest are only in metrics and the flight recorder)."""

    head_ratio: float = DEFAULT_HEAD_RATIO  # random fraction of prompt groups traced in full
    keep_slowest: int = 4  # per step, the slowest samples' trees (KeepTraces)
    ring_size: int = 32768  # samples each process remembers for a later keep decision

    @classmethod
    def from_env(cls) -> TraceConfig:
        sampler = os.environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
        arg = os.environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
        ratio = DEFAULT_HEAD_RATIO
        if sampler in ("always_on", "parentbased_always_on"):
            ratio = 1.0
        elif sampler in ("always_off", "parentbased_always_off"):
            ratio = 0.0
        elif sampler in ("traceidratio", "parentbased_traceidratio"):
            try:
                ratio = float(arg) if arg else 1.0
            except ValueError:
                raise SystemExit(f"OTEL_TRACES_SAMPLER_ARG={arg!r}: not a number") from None
        keep = os.environ.get("REWARDMESH_TRACE_KEEP_SLOWEST", "4")
        ring = os.environ.get("REWARDMESH_TRACE_RING_SIZE", "32768")
        try:
            return cls(min(1.0, max(0.0, ratio)), max(0, int(keep)), max(1, int(ring)))
        except ValueError:
            raise SystemExit(f"REWARDMESH_TRACE_KEEP_SLOWEST={keep!r} / REWARDMESH_TRACE_RING_SIZE={ring!r}") from None


@dataclass
class Telemetry:
    """What setup installed: enabled flags and the providers (None when left as no-ops)."""

    tracing: bool = False
    metrics: bool = False
    tracer_provider: TracerProvider | None = None
    meter_provider: MeterProvider | None = None
    trace: TraceConfig = field(default_factory=TraceConfig)
    recorder: FlightRecorder | None = None

    def shutdown(self) -> None:
        if self.tracer_provider is not None:
            self.tracer_provider.force_flush()
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()


_installed: Telemetry | None = None
_lock = threading.Lock()


def resource(role: str, **attributes: Any) -> Resource:
    attrs: dict[str, Any] = {
        "service.name": os.environ.get("OTEL_SERVICE_NAME") or f"rewardmesh-{role}",
        "rewardmesh.role": role,
        "host.name": socket.gethostname(),
    }
    pod = os.environ.get("POD_NAME") or os.environ.get("HOSTNAME")
    if pod:
        attrs["k8s.pod.name"] = pod
    attrs.update(attributes)
    return Resource.create(attrs)  # merges OTEL_RESOURCE_ATTRIBUTES


def _span_exporters(names: Sequence[str]) -> list[SpanExporter]:
    out: list[SpanExporter] = []
    for name in names:
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            out.append(ConsoleSpanExporter())
        elif name == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            except ImportError:
                raise SystemExit("OTEL_TRACES_EXPORTER=otlp needs: pip install 'rewardmesh[otlp]'") from None
            out.append(OTLPSpanExporter())
        elif name not in ("none", ""):
            raise SystemExit(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (otlp, console, none)")
    return out


def _metric_readers(names: Sequence[str], prometheus_port: int) -> list[MetricReader]:
    readers: list[MetricReader] = []
    if prometheus_port and "prometheus" not in names:
        names = [*names, "prometheus"]
    for name in names:
        if name == "console":
            from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
        elif name == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
                from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
            except ImportError:
                raise SystemExit("OTEL_METRICS_EXPORTER=otlp needs: pip install 'rewardmesh[otlp]'") from None
            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        elif name == "prometheus":
            try:
                from opentelemetry.exporter.prometheus import PrometheusMetricReader
                from prometheus_client import start_http_server
            except ImportError:
                raise SystemExit("a Prometheus endpoint needs: pip install 'rewardmesh[prometheus]'") from None
            start_http_server(prometheus_port or 9464)
            readers.append(PrometheusMetricReader())
            log.info("Prometheus metrics on :%d/metrics", prometheus_port or 9464)
        elif name not in ("none", ""):
            raise SystemExit(f"OTEL_METRICS_EXPORTER: unknown exporter {name!r} (otlp, console, prometheus, none)")
    return readers


class SerializedExporter(SpanExporter):
    """An exporter fed by two threads, the SDK's batch processor (step and RPC spans) and the flight recorder's
    builder (kept trees), one call at a time: the SDK never calls an exporter concurrently, and exporters rely
    on it. Blocks pass through to an exporter that writes them itself."""

    export_blocks: Callable[[Resource, Sequence[SpanBlock]], SpanExportResult] | None = None

    def __init__(self, exporter: SpanExporter) -> None:
        self.exporter = exporter
        self._lock = threading.Lock()
        if getattr(exporter, "export_blocks", None) is not None:
            self.export_blocks = self._export_blocks

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            return self.exporter.export(spans)

    def _export_blocks(self, resource: Resource, blocks: Sequence[SpanBlock]) -> SpanExportResult:
        with self._lock:
            return self.exporter.export_blocks(resource, blocks)  # type: ignore[attr-defined]

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)

    def shutdown(self) -> None:
        with self._lock:
            self.exporter.shutdown()


def setup_telemetry(
    role: str,
    *,
    span_exporters: Sequence[SpanExporter] = (),
    span_processors: Sequence[SpanProcessor] = (),
    metric_readers: Sequence[MetricReader] = (),
    prometheus_port: int = 0,
    **resource_attributes: Any,
) -> Telemetry:
    """Install providers once per process; exporters come from OTEL_* plus what the caller passes."""
    global _installed
    with _lock:
        if _installed is not None:
            return _installed
        env_traces = [x.strip() for x in os.environ.get("OTEL_TRACES_EXPORTER", "none").split(",")]
        env_metrics = [x.strip() for x in os.environ.get("OTEL_METRICS_EXPORTER", "none").split(",")]
        exporters = [*_span_exporters(env_traces), *span_exporters]
        readers = [*_metric_readers(env_metrics, prometheus_port), *metric_readers]
        telemetry = Telemetry(trace=TraceConfig.from_env())
        res = resource(role, **resource_attributes)
        if exporters or span_processors:
            # Step and RPC spans: roots always, children as their parent. Per-sample trees follow TraceConfig.
            provider = TracerProvider(resource=res, sampler=ParentBased(ALWAYS_ON))
            # Kept sample trees go from the flight recorder straight to the exporters; the SDK's own spans (steps,
            # RPCs) through a batch processor each. Both feed one exporter, so it is wrapped to be fed in turn.
            shared = [SerializedExporter(e) for e in exporters]
            recorder = FlightRecorder(res, telemetry.trace.ring_size, shared, span_processors)
            provider.add_span_processor(recorder.flusher())  # first: deferred spans join every flush
            for exporter in shared:
                provider.add_span_processor(BatchSpanProcessor(exporter))
            for sp in span_processors:
                provider.add_span_processor(sp)
            trace.set_tracer_provider(provider)
            telemetry.tracing, telemetry.tracer_provider = True, provider
            telemetry.recorder = recorder
        if readers:
            meter_provider = MeterProvider(resource=res, metric_readers=list(readers), views=batched_metrics.views())
            batched_metrics.mark_views_installed()
            metrics.set_meter_provider(meter_provider)
            telemetry.metrics, telemetry.meter_provider = True, meter_provider
        _installed = telemetry
        return telemetry


def tracing_enabled() -> bool:
    return _installed is not None and _installed.tracing


def metrics_enabled() -> bool:
    return _installed is not None and _installed.metrics


def recorder() -> FlightRecorder | None:
    """This process's flight recorder; None when tracing is off (record nothing then)."""
    return _installed.recorder if _installed is not None else None


def trace_config() -> TraceConfig:
    return _installed.trace if _installed is not None else TraceConfig()


def group_context(step: trace.Span, sampled: bool) -> otel_context.Context | None:
    """The context a prompt group's calls run in: the step span, with the group's head-sampling decision in
    the trace flags and the step's span id in the tracestate (None when the step is not recorded)."""
    ctx = step.get_span_context()
    if not ctx.is_valid or not step.is_recording():
        return None
    span_ctx = SpanContext(
        ctx.trace_id,
        ctx.span_id,
        is_remote=False,
        trace_flags=TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT),
        trace_state=TraceState([(STEP_KEY, f"{ctx.span_id:016x}")]),
    )
    return trace.set_span_in_context(NonRecordingSpan(span_ctx))


# Fetched once: get_tracer() builds a new Tracer on every call. Before setup these are proxies that
# follow the providers installed later.
_TRACER = trace.get_tracer(TRACER_NAME)
_METER = metrics.get_meter(TRACER_NAME)


def tracer() -> trace.Tracer:
    return _TRACER


def meter() -> metrics.Meter:
    return _METER


def inject(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """W3C trace context of `ctx` (default: the current one) as a string map."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


def extract(carrier: Any) -> otel_context.Context:
    """A context from a string map or gRPC metadata (a sequence of key/value pairs)."""
    if carrier is None:
        return otel_context.Context()
    if not isinstance(carrier, dict):
        carrier = {k: v for k, v in carrier if isinstance(v, str)}
    return propagate.extract(carrier)


def _not_score() -> Any:
    """RPC spans for every method but the long-lived Score stream: one span lasting hours says nothing, its
    per-message bookkeeping costs every sample, and each sample's own context travels in its message."""
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(filters.method_name("Score"))


def client_interceptors() -> list[Any]:
    """OpenTelemetry's gRPC client interceptors (RPC semantic conventions), when tracing is on."""
    if not tracing_enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors(filter_=_not_score()))


def server_interceptors() -> list[Any]:
    if not tracing_enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(filter_=_not_score())]


# -- OTLP JSON lines ----------------------------------------------------------------------------


def _value(v: Any) -> dict[str, Any]:
    t = type(v)  # the common types first, by exact type (this runs for every attribute of every span)
    if t is str:
        return {"stringValue": v}
    if t is int:
        return {"intValue": str(v)}
    if t is float:
        return {"doubleValue": v}
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, list | tuple):
        return {"arrayValue": {"values": [_value(x) for x in v]}}
    return {"stringValue": str(v)}


def _attrs(attributes: Any) -> list[dict[str, Any]]:
    if not attributes:
        return []
    return [{"key": k, "value": _value(v)} for k, v in attributes.items()]


_KIND = {k: int(k.value) + 1 for k in trace.SpanKind}  # OTLP numbers kinds from SPAN_KIND_INTERNAL = 1
_STATUS = {c: int(c.value) for c in trace.StatusCode}
# The same by the member's id: an Enum's hash is a Python-level call, and span_json looks both up per span.
_KIND_OF = {id(k): v for k, v in _KIND.items()}
_STATUS_OF = {id(c): v for c, v in _STATUS.items()}


def span_to_otlp(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    assert ctx is not None
    out: dict[str, Any] = {
        "traceId": f"{ctx.trace_id:032x}",
        "spanId": f"{ctx.span_id:016x}",
        "name": span.name,
        "kind": _KIND[span.kind],
        "startTimeUnixNano": str(span.start_time),
        "endTimeUnixNano": str(span.end_time),
        "attributes": _attrs(span.attributes),
        "events": [
            {"name": e.name, "timeUnixNano": str(e.timestamp), "attributes": _attrs(e.attributes)} for e in span.events
        ]
        if span.events
        else [],
        "links": [
            {
                "traceId": f"{link.context.trace_id:032x}",
                "spanId": f"{link.context.span_id:016x}",
                "attributes": _attrs(link.attributes),
            }
            for link in span.links
        ]
        if span.links
        else [],
        "status": {"code": _STATUS[span.status.status_code]}
        | ({"message": span.status.description} if span.status.description else {}),
    }
    parent = span.parent
    if parent is not None:
        out["parentSpanId"] = f"{parent.span_id:016x}"
    return out


_esc = json.encoder.encode_basestring  # a quoted, escaped JSON string (the C implementation)
_INF = float("inf")


def _value_json(v: Any) -> str:
    t = type(v)
    if t is str:
        return '{"stringValue":' + _esc(v) + "}"
    if t is int:
        return f'{{"intValue":"{v}"}}'
    if t is float and v == v and v not in (_INF, -_INF):
        return '{"doubleValue":' + repr(v) + "}"
    return json.dumps(_value(v))


_KEY_JSON: dict[str, str] = {}  # attribute key -> its '{"key":...,"value":' prefix
_NAME_JSON: dict[str, str] = {}  # span name -> its JSON text


def _cached(cache: dict[str, str], key: str, text: str) -> str:
    if len(cache) < 4096:  # keys and names repeat across spans; a flood of distinct ones is not cached
        cache[key] = text
    return text


def _key_prefix(key: str) -> str:
    """An attribute's '{"key":...,"value":' text, cached."""
    return _KEY_JSON.get(key) or _cached(_KEY_JSON, key, '{"key":' + _esc(key) + ',"value":')


def _attr_items(attributes: Any) -> str:
    """A mapping's attributes as OTLP/JSON key-values, without the brackets around them."""
    parts = []
    for k, v in attributes.items():
        prefix = _key_prefix(k)
        t = type(v)
        if t is str:
            parts.append(f'{prefix}{{"stringValue":{_esc(v)}}}}}')
        elif t is int:
            parts.append(f'{prefix}{{"intValue":"{v}"}}}}')
        elif t is float and v - v == 0:  # finite (inf - inf and nan - nan are nan)
            parts.append(f'{prefix}{{"doubleValue":{v!r}}}}}')
        else:
            parts.append(prefix + _value_json(v) + "}")
    return ",".join(parts)


def _attrs_json(attributes: Any) -> str:
    return "[" + _attr_items(attributes) + "]" if attributes else "[]"


def _status_json(code: int, message: str | None) -> str:
    return f'{{"code":{code},"message":{_esc(message)}}}' if message else f'{{"code":{code}}}'


def _event_json(e: Any) -> str:
    return (
        '{"name":' + _esc(e.name) + f',"timeUnixNano":"{e.timestamp}","attributes":' + _attrs_json(e.attributes) + "}"
    )


def _link_json(link: Any) -> str:
    ctx = link.context
    return (
        f'{{"traceId":"{ctx.trace_id:032x}","spanId":"{ctx.span_id:016x}","attributes":{_attrs_json(link.attributes)}}}'
    )


def span_json(span: ReadableSpan) -> str:
    """`span_to_otlp(span)` as JSON text, written directly. A plain ReadableSpan (what every processor is handed)
    is read from its fields: its properties copy (`attributes`, `events` and `links` each build a new object per
    call), and a SpanContext is a tuple (trace id, span id, ...) whose own properties are Python calls."""
    if type(span) is ReadableSpan and FAST_SPANS:
        f = span.__dict__
        ctx, parent, events, links = f["_context"], f["_parent"], f["_events"], f["_links"]
        name, kind, start, end = f["_name"], f["_kind"], f["_start_time"], f["_end_time"]
        attributes, status = f["_attributes"], f["_status"]
    else:
        ctx, parent, events, links = span.get_span_context(), span.parent, span.events, span.links
        name, kind, start, end = span.name, span.kind, span.start_time, span.end_time
        attributes, status = span.attributes, span.status
    assert ctx is not None
    has_parent = f'"parentSpanId":"{parent[1]:016x}",' if parent is not None else ""
    return (
        f'{{"traceId":"{ctx[0]:032x}","spanId":"{ctx[1]:016x}",{has_parent}'
        f'"name":{_esc(name)},"kind":{_KIND_OF[id(kind)]},'
        f'"startTimeUnixNano":"{start}","endTimeUnixNano":"{end}",'
        f'"attributes":{_attrs_json(attributes)},'
        f'"events":[{",".join(map(_event_json, events)) if events else ""}],'
        f'"links":[{",".join(map(_link_json, links)) if links else ""}],'
        f'"status":{_status_json(_STATUS_OF[id(status.status_code)], status.description)}}}'
    )


_OK_JSON = '{"code":0}'
_ERROR = _STATUS[trace.StatusCode.ERROR]


def _column_json(key: str, values: Sequence[Any]) -> list[str]:
    """One attribute's key-value text for each span of a block (the values' type checked once per column)."""
    prefix = _key_prefix(key)
    types = set(map(type, values))
    if types == {str}:
        return [f'{prefix}{{"stringValue":{v}}}}}' for v in map(_esc, values)]
    if types == {int}:
        return [f'{prefix}{{"intValue":"{v}"}}}}' for v in values]
    if types == {float}:
        return [f'{prefix}{{"doubleValue":{v!r}}}}}' if v - v == 0 else f"{prefix}{_value_json(v)}}}" for v in values]
    return [f"{prefix}{_value_json(v)}}}" for v in values]


def block_json(block: SpanBlock) -> list[str]:
    """The text `span_json` writes for each of a block's spans, written column by column: one formatted string
    per span, everything the spans share written once."""
    n = len(block.span_ids)
    head = (f'"name":{_NAME_JSON.get(block.name) or _cached(_NAME_JSON, block.name, _esc(block.name))},'
            f'"kind":{_KIND_OF[id(block.kind)]},')  # fmt: skip
    shared = _attr_items(block.attributes) if block.attributes else ""
    columns = [_column_json(k, v) for k, v in block.columns.items()]
    if not columns:
        attrs: Iterable[str] = itertools.repeat("", n)
    else:
        attrs = columns[0] if len(columns) == 1 else [",".join(t) for t in zip(*columns, strict=True)]
        shared += "," if shared else ""
    parents: Iterable[str] = (
        itertools.repeat("", n) if block.parent_ids is None else [f'"parentSpanId":"{p}",' for p in block.parent_ids]
    )
    statuses: Iterable[str] = (
        itertools.repeat(_OK_JSON, n)
        if block.errors is None
        else [_OK_JSON if e is None else _status_json(_ERROR, e) for e in block.errors]
    )
    links: Iterable[str] = (
        itertools.repeat("", n)
        if block.links is None
        else [",".join([f'{{"traceId":"{t}","spanId":"{s}","attributes":[]}}' for t, s, _ in ls]) for ls in block.links]
    )
    return [
        f'{{"traceId":"{t}","spanId":"{s:016x}",{p}{head}"startTimeUnixNano":"{b}","endTimeUnixNano":"{e}",'
        f'"attributes":[{shared}{a}],"events":[],"links":[{lk}],"status":{st}}}'
        for t, s, p, b, e, a, lk, st in zip(
            block.trace_ids, block.span_ids, parents, block.starts, block.ends, attrs, links, statuses, strict=False
        )
    ]


_SCOPE_SPANS = '"scopeSpans":[{"scope":{"name":' + _esc(TRACER_NAME) + '},"spans":['


class OtlpJsonLinesExporter(SpanExporter):
    """Writes each export as one OTLP/JSON `ExportTraceServiceRequest` line (the collector file exporter's format)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w")
        self._lock = threading.Lock()
        self._resources: dict[int, tuple[Resource, str]] = {}  # id -> (resource kept alive, its JSON)

    def _resource_json(self, res: Resource) -> str:
        known = self._resources.get(id(res))
        if known is None or known[0] is not res:
            known = self._resources[id(res)] = (res, '{"attributes":' + _attrs_json(res.attributes) + "}")
        return known[1]

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        by_resource: dict[int, tuple[Resource, list[ReadableSpan]]] = {}
        for span in spans:
            by_resource.setdefault(id(span.resource), (span.resource, []))[1].append(span)
        return self._write(
            ",".join(self._resource_spans(res, ",".join(map(span_json, group))) for res, group in by_resource.values())
        )

    def export_blocks(self, resource: Resource, blocks: Sequence[SpanBlock]) -> SpanExportResult:
        """The flight recorder's kept spans, written from its blocks (no span objects)."""
        return self._write(self._resource_spans(resource, ",".join([",".join(block_json(b)) for b in blocks])))

    def _resource_spans(self, res: Resource, spans_json: str) -> str:
        return '{"resource":' + self._resource_json(res) + "," + _SCOPE_SPANS + spans_json + "]}]}"

    def _write(self, resource_spans: str) -> SpanExportResult:
        with self._lock:
            self._file.write('{"resourceSpans":[' + resource_spans + "]}\n")
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()
