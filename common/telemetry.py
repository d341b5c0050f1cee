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

import logging
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
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
from rewardmesh.common.flight_recorder import BlockExporter, FlightRecorder, SpanBlock

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
    on it. `serialized` wraps an exporter so."""

    def __init__(self, exporter: SpanExporter) -> None:
        self.exporter = exporter
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            return self.exporter.export(spans)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)

    def shutdown(self) -> None:
        with self._lock:
            self.exporter.shutdown()


class SerializedBlockExporter(SerializedExporter, BlockExporter):
    """As SerializedExporter, for an exporter that writes the recorder's blocks itself: they pass through."""

    def __init__(self, exporter: BlockExporter) -> None:
        super().__init__(exporter)
        self.blocks = exporter

    def export_blocks(self, resource: Resource, blocks: Sequence[SpanBlock]) -> SpanExportResult:
        with self._lock:
            return self.blocks.export_blocks(resource, blocks)


def serialized(exporter: SpanExporter) -> SerializedExporter:
    """`exporter`, fed one call at a time; still a BlockExporter if it was one."""
    if isinstance(exporter, BlockExporter):
        return SerializedBlockExporter(exporter)
    return SerializedExporter(exporter)


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
            shared = [serialized(e) for e in exporters]
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
