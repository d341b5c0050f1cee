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
from array import array
from collections.abc import Sequence
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

    values: np.ndarray

    def __new__(cls, values: np.ndarray) -> _Values:
        obj = super().__new__(cls, float(values.sum()))
        obj.values = values
        return obj


if _ExplicitBucketHistogramAggregation is not None:

    class _BucketsWithBatches(_ExplicitBucketHistogramAggregation):
        def aggregate(self, measurement: Any, should_sample_exemplar: bool = True) -> None:
            value = measurement.value
            if not isinstance(value, _Values):  # one value, recorded as usual
                super().aggregate(measurement, should_sample_exemplar)
                return
            values = value.values
            if not len(values):
                return
            # Bucket indexes as bisect_left gives them, in one vectorized pass.
            per_bucket = np.bincount(np.searchsorted(self._boundaries, values, side="left"),
                                     minlength=len(self._boundaries) + 1)  # fmt: skip
            added = [(i, int(c)) for i, c in enumerate(per_bucket.tolist()) if c]
            with self._lock:
                counts: list[int] = self._value if self._value is not None else self._get_empty_bucket_counts()
                self._value = counts  # type: ignore[assignment]
                for i, c in added:
                    counts[i] += c
                self._sum += float(measurement.value)  # type: ignore[assignment]
                if self._record_min_max:
                    self._min = min(self._min, float(values.min()))
                    self._max = max(self._max, float(values.max()))


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
    """Values and counts collected per attribute set and flushed to the SDK in one call per instrument.

    Held compactly: a batch of samples' timings is one float array and one number, not an object per value
    (floats held until the next collection, tens of thousands of them, cost the event loop more than
    recording them did). Appending is a dict lookup and a list append, no lock: the flush takes blocks off
    the front of each list with two single C-level list operations (copy the first n, delete the first n), so
    a block appended meanwhile from another thread stays for the next flush, never lost or counted twice (the
    GIL makes each of those operations atomic). The owner flushes at every metric collection (so nothing
    recorded before a collection is missing from it), and appending flushes once `max_pending` values wait
    (bounded memory between collections).
    """

    def __init__(self, max_pending: int = 16384) -> None:
        self.max_pending = max_pending
        self._lock = threading.Lock()  # one flush at a time; new block lists
        self._timings: dict[tuple[Counter, tuple[Histogram, ...], str], list[tuple[array, float]]] = {}
        self._values: dict[tuple[Histogram, str], list[float]] = {}
        self._counts: dict[tuple[Counter, str], list[int]] = {}
        self._attrs: dict[str, dict[str, str]] = {}
        self._waiting = 0  # values added since the last flush (a trigger, not an exact count)

    def add_timings(
        self,
        counter: Counter,
        histograms: tuple[Histogram, Histogram, Histogram],
        pipeline: str,
        queue_s: Sequence[float],
        compute_s: float,
    ) -> None:
        """A batch of n samples under `pipeline`: `counter` += n, and sample i's latency (queue_s[i] + compute_s),
        queue time (queue_s[i]) and compute time (compute_s) recorded in `histograms` (in that order)."""
        _pending(self._timings, (counter, histograms, pipeline), self._lock).append((array("d", queue_s), compute_s))
        self._waiting += len(queue_s)
        if self._waiting >= self.max_pending:
            self.flush()

    def add(self, histogram: Histogram, pipeline: str, value: float) -> None:
        _pending(self._values, (histogram, pipeline), self._lock).append(value)

    def count(self, counter: Counter, pipeline: str, n: int = 1) -> None:
        _pending(self._counts, (counter, pipeline), self._lock).append(n)

    def flush(self) -> None:
        with self._lock:
            self._waiting = 0
            for (counter, (latency, queue, compute), pipeline), pending in list(self._timings.items()):
                n = len(pending)
                if not n:
                    continue
                blocks = pending[:n]
                del pending[:n]
                queued = np.concatenate([np.frombuffer(q, dtype=np.float64) for q, _ in blocks])
                computed = np.repeat(np.array([c for _, c in blocks]), [len(q) for q, _ in blocks])
                attrs = self._attributes(pipeline)
                _record(latency, queued + computed, attrs)
                _record(queue, queued, attrs)
                _record(compute, computed, attrs)
                counter.add(len(queued), attrs)
            for (histogram, pipeline), pending_values in list(self._values.items()):
                n = len(pending_values)
                if n:
                    values = np.array(pending_values[:n], dtype=np.float64)
                    del pending_values[:n]
                    _record(histogram, values, self._attributes(pipeline))
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


def _pending(table: dict[Any, list[Any]], key: Any, lock: threading.Lock) -> list[Any]:
    """The list of what waits under `key`, made under the lock the first time (a flush may be iterating)."""
    items = table.get(key)
    if items is None:
        with lock:
            items = table.setdefault(key, [])
    return items


def _record(histogram: Histogram, values: np.ndarray, attrs: dict[str, str]) -> None:
    """All of `values` in one measurement through the batched view; one by one without it."""
    if _views_installed:
        histogram.record(_Values(values), attrs)
    else:
        for v in values.tolist():
            histogram.record(v, attrs)
