"""OTLP/JSON: spans written as the OpenTelemetry collector's file exporter writes them, one
`ExportTraceServiceRequest` per line (`OtlpJsonLinesExporter`), from SDK spans or straight from the flight
recorder's blocks. The text is written directly, not built as dicts and dumped: this runs for every kept span."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult

from rewardmesh.common.flight_recorder import FAST_SPANS, BlockExporter, SpanBlock
from rewardmesh.common.telemetry import TRACER_NAME


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


class OtlpJsonLinesExporter(BlockExporter):
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
