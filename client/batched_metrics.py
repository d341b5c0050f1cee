"""Histograms fed per batch: exact counts and bucket shape, one SDK call per batch instead of one per sample.

The OpenTelemetry SDK spends tens of microseconds of Python on every `Histogram.record` (measurement
object, exemplar filter, attribute hashing, locks); at thousands of samples per second that is most of a
cheap reward rule's cost. `HistogramBatch` collects values in plain lists and hands them to the SDK as one
measurement; the view installed by `setup_telemetry` (`BatchedHistogramAggregation`) unpacks it into the
same explicit-bucket aggregation (count, sum, min, max, buckets) that per-value calls would have built.
Without that view (a MeterProvider installed by someone else) values are recorded one by one.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from typing import Any

import numpy as np
from opentelemetry.metrics import Counter, Histogram
from opentelemetry.sdk.metrics import Histogram as SdkHistogram
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

try:  # the SDK's explicit-bucket aggregation; if a future SDK moves it, values are recorded one by one
    from opentelemetry.sdk.metrics._internal.aggregation import _ExplicitBucketHistogramAggregation
except ImportError:  # pragma: no cover
    _ExplicitBucketHistogramAggregation = None  # type: ignore[assignment,misc]

SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


class _Values(float):
    """Several values passed through `Histogram.record` as one measurement (the float itself is their sum)."""

    values: list[float]

    def __new__(cls, values: list[float]) -> _Values:
        obj = super().__new__(cls, sum(values))
        obj.values = values
        return obj


if _ExplicitBucketHistogramAggregation is not None:

    class _BucketsWithBatches(_ExplicitBucketHistogramAggregation):
        def aggregate(self, measurement: Any, should_sample_exemplar: bool = True) -> None:
            values = getattr(measurement.value, "values", None)
            if values is None:
                super().aggregate(measurement, should_sample_exemplar)
                return
            if not values:
                return
            bounds = self._boundaries
            if len(values) > 32:  # bucket indexes as bisect_left gives them, in one vectorized pass
                per_bucket = np.bincount(np.searchsorted(bounds, values, side="left"), minlength=len(bounds) + 1)
                added = [(i, int(c)) for i, c in enumerate(per_bucket.tolist()) if c]
            else:
                added = [(bisect_left(bounds, v), 1) for v in values]
            with self._lock:
                counts: list[int] = self._value if self._value is not None else self._get_empty_bucket_counts()
                self._value = counts  # type: ignore[assignment]
                for i, c in added:
                    counts[i] += c
                self._sum += float(measurement.value)  # type: ignore[assignment]
                if self._record_min_max:
                    self._min = min(self._min, min(values))
                    self._max = max(self._max, max(values))


class BatchedHistogramAggregation(ExplicitBucketHistogramAggregation):
    """The SDK's explicit-bucket histogram, also accepting a batch of values as one measurement."""

    def _create_aggregation(self, *args: Any, **kwargs: Any) -> Any:
        agg = super()._create_aggregation(*args, **kwargs)
        if _ExplicitBucketHistogramAggregation is not None and type(agg) is _ExplicitBucketHistogramAggregation:
            agg.__class__ = _BucketsWithBatches  # same state, one more way in
        return agg


def views() -> list[View]:
    """Views for setup_telemetry's MeterProvider: rewardmesh's histograms take batches."""
    if _ExplicitBucketHistogramAggregation is None:  # pragma: no cover
        return []
    return [
        View(instrument_name="rewardmesh.*", instrument_type=SdkHistogram, aggregation=BatchedHistogramAggregation())
    ]


_views_installed = False


def mark_views_installed() -> None:
    global _views_installed
    _views_installed = _ExplicitBucketHistogramAggregation is not None


class HistogramBatch:
    """Rows of values and counts collected per attribute set and flushed to the SDK in one call each.

    `add_row` is a dict lookup and a list append, no lock: the flush takes rows off the front of each list
    with two single C-level list operations (copy the first n, delete the first n), so a row appended
    meanwhile from another thread stays for the next flush, never lost or counted twice (the GIL makes
    each of those operations atomic). The owner flushes at every metric collection (so nothing recorded
    before a collection is missing from it) and `add_row` flushes every `max_pending` rows of an attribute
    set (bounded memory between collections).
    """

    def __init__(self, max_pending: int = 4096) -> None:
        self.max_pending = max_pending
        self._lock = threading.Lock()  # one flush at a time; new row lists
        self._rows: dict[tuple[Counter | None, tuple[Histogram, ...], str], list[tuple[float, ...]]] = {}
        self._counts: dict[tuple[Counter, str], list[int]] = {}
        self._attrs: dict[str, dict[str, str]] = {}

    def add_row(
        self, counter: Counter | None, histograms: tuple[Histogram, ...], pipeline: str, row: tuple[float, ...]
    ) -> None:
        """One sample: `counter` += 1 and row[i] recorded in histograms[i], all under `pipeline`."""
        key = (counter, histograms, pipeline)
        rows = self._rows.get(key)
        if rows is None:
            with self._lock:
                rows = self._rows.setdefault(key, [])
        rows.append(row)
        if len(rows) >= self.max_pending:
            self.flush()

    def rows(
        self, counter: Counter | None, histograms: tuple[Histogram, ...], pipeline: str
    ) -> list[tuple[float, ...]]:
        """The list `add_row` appends to for this key: a hot path may keep it and append itself (then call
        `flush` when it reaches `max_pending`); flushes take rows off its front, the list stays the same."""
        key = (counter, histograms, pipeline)
        rows = self._rows.get(key)
        if rows is None:
            with self._lock:
                rows = self._rows.setdefault(key, [])
        return rows

    def add(self, histogram: Histogram, pipeline: str, value: float) -> None:
        self.add_row(None, (histogram,), pipeline, (value,))

    def count(self, counter: Counter, pipeline: str, n: int = 1) -> None:
        key = (counter, pipeline)
        ns = self._counts.get(key)
        if ns is None:
            with self._lock:
                ns = self._counts.setdefault(key, [])
        ns.append(n)

    def flush(self) -> None:
        with self._lock:
            for (counter, histograms, pipeline), pending in list(self._rows.items()):
                n = len(pending)
                if not n:
                    continue
                rows = pending[:n]
                del pending[:n]
                attrs = self._attributes(pipeline)
                for hist, column in zip(histograms, zip(*rows, strict=True), strict=False):
                    values = list(column)
                    if _views_installed:
                        hist.record(_Values(values), attrs)
                    else:
                        for v in values:
                            hist.record(v, attrs)
                if counter is not None:
                    counter.add(n, attrs)
            for (counter, pipeline), pending_counts in list(self._counts.items()):
                n = len(pending_counts)
                if n:
                    total = sum(pending_counts[:n])
                    del pending_counts[:n]
                    counter.add(total, self._attributes(pipeline))

    def _attributes(self, pipeline: str) -> dict[str, str]:
        attrs = self._attrs.get(pipeline)
        if attrs is None:
            attrs = self._attrs[pipeline] = {"pipeline": pipeline}
        return attrs
