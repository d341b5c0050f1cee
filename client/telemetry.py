"""OpenTelemetry for every rewardmesh process, configured by the standard OTEL_* environment variables.

Nothing is exported unless asked for: with OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER unset (or
"none") the API's no-op providers stay in place and a span costs a function call. Exporters:
`otlp` (needs the `rewardmesh[otlp]` extra), `console`, and `prometheus` for metrics (a scrape
endpoint, `rewardmesh[prometheus]`). Sampling follows OTEL_TRACES_SAMPLER(_ARG). Resource
attributes: service name (OTEL_SERVICE_NAME, else rewardmesh-<role>), role, host, pod.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Sequence
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

log = logging.getLogger(__name__)

TRACER_NAME = "rewardmesh"


@dataclass
class Telemetry:
    """What setup installed: enabled flags and the providers (None when left as no-ops)."""

    tracing: bool = False
    metrics: bool = False
    tracer_provider: TracerProvider | None = None
    meter_provider: MeterProvider | None = None
    processors: list[SpanProcessor] = field(default_factory=list)

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
        telemetry = Telemetry()
        res = resource(role, **resource_attributes)
        if exporters or span_processors:
            provider = TracerProvider(resource=res)  # sampler from OTEL_TRACES_SAMPLER
            for exporter in exporters:
                processor = BatchSpanProcessor(exporter)
                provider.add_span_processor(processor)
                telemetry.processors.append(processor)
            for sp in span_processors:
                provider.add_span_processor(sp)
                telemetry.processors.append(sp)
            trace.set_tracer_provider(provider)
            telemetry.tracing, telemetry.tracer_provider = True, provider
        if readers:
            meter_provider = MeterProvider(resource=res, metric_readers=list(readers))
            metrics.set_meter_provider(meter_provider)
            telemetry.metrics, telemetry.meter_provider = True, meter_provider
        _installed = telemetry
        return telemetry


def tracing_enabled() -> bool:
    return _installed is not None and _installed.tracing


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


def span_context_in(ctx: otel_context.Context | None) -> trace.SpanContext | None:
    """The valid span context a context carries, if any (what a span link points at)."""
    if ctx is None:
        return None
    span_ctx = trace.get_current_span(ctx).get_span_context()
    return span_ctx if span_ctx.is_valid else None


def traceparent(span: trace.Span) -> dict[str, str]:
    return inject(trace.set_span_in_context(span))


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
    return [{"key": k, "value": _value(v)} for k, v in (attributes or {}).items()]


def span_to_otlp(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    assert ctx is not None
    out: dict[str, Any] = {
        "traceId": f"{ctx.trace_id:032x}",
        "spanId": f"{ctx.span_id:016x}",
        "name": span.name,
        "kind": int(span.kind.value) + 1,  # OTLP numbers kinds from SPAN_KIND_INTERNAL = 1
        "startTimeUnixNano": str(span.start_time),
        "endTimeUnixNano": str(span.end_time),
        "attributes": _attrs(span.attributes),
        "events": [
            {"name": e.name, "timeUnixNano": str(e.timestamp), "attributes": _attrs(e.attributes)} for e in span.events
        ],
        "links": [
            {
                "traceId": f"{link.context.trace_id:032x}",
                "spanId": f"{link.context.span_id:016x}",
                "attributes": _attrs(link.attributes),
            }
            for link in span.links
        ],
        "status": {"code": int(span.status.status_code.value)},
    }
    if span.parent is not None:
        out["parentSpanId"] = f"{span.parent.span_id:016x}"
    return out


class OtlpJsonLinesExporter(SpanExporter):
    """Writes each export as one OTLP/JSON `ExportTraceServiceRequest` line (the collector file exporter's format)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        by_resource: dict[int, tuple[Resource, list[ReadableSpan]]] = {}
        for span in spans:
            by_resource.setdefault(id(span.resource), (span.resource, []))[1].append(span)
        line = {
            "resourceSpans": [
                {
                    "resource": {"attributes": _attrs(res.attributes)},
                    "scopeSpans": [{"scope": {"name": TRACER_NAME}, "spans": [span_to_otlp(s) for s in group]}],
                }
                for res, group in by_resource.values()
            ]
        }
        with self._lock:
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()
