"""Counters and histograms of one mount, and their exposition.

One prometheus_client registry per daemon; `snapshot()` turns it into the
plain dict that `tierfs status` prints, so the two can never disagree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_M = TypeVar("_M", Counter, Histogram)  # a labelled metric, or one of its children

LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)


# Figures read at scrape time from the parts that own them (the cache's own
# counters, the write path's pending uploads): name -> (kind, help).
LIVE_METRICS: dict[str, tuple[str, str]] = {
    "tierfs_cache_objects": ("gauge", "Objects with data in tier 1"),
    "tierfs_cache_open_objects": ("gauge", "Tier-1 objects open right now"),
    "tierfs_evictions": ("counter", "Objects or chunks evicted from tier 1"),
    "tierfs_evicted_bytes": ("counter", "Bytes evicted from tier 1"),
    "tierfs_corrupt_chunks": ("counter", "Tier-1 chunks that failed their checksum and were dropped"),
    "tierfs_pending_uploads": ("gauge", "Files written but not yet uploaded to the store"),
    "tierfs_pending_upload_bytes": ("gauge", "Bytes written but not yet uploaded to the store"),
    "tierfs_pending_upload_oldest_seconds": ("gauge", "Age of the oldest pending upload"),
    "tierfs_quarantined_files": ("gauge", "Files kept aside after a rejected upload (conflicts/)"),
    # The shared tier (sharedtier/), where one is configured.
    "tierfs_shared_hits": ("counter", "Blocks taken from the shared tier (verified)"),
    "tierfs_shared_misses": ("counter", "Blocks not in the shared tier (valid) at first look"),
    "tierfs_shared_corrupt_blocks": ("counter", "Shared-tier blocks that failed verification "
                                     "(never served; fetched from the origin)"),
    "tierfs_shared_claims_won": ("counter", "Blocks this node claimed, fetched and put"),
    "tierfs_shared_claims_lost": ("counter", "Blocks another node had claimed (this one waited)"),
    "tierfs_shared_claims_expired": ("counter", "Waits that outlived the claim's lease"),
    "tierfs_shared_own_fetches": ("counter", "Blocks fetched from the origin for this node alone"),
    "tierfs_shared_puts": ("counter", "Blocks put into the shared tier"),
    "tierfs_shared_put_failures": ("counter", "Blocks the shared tier did not take"),
    "tierfs_shared_errors": ("counter", "Shared-tier failures (the origin served instead)"),
    "tierfs_shared_bytes_from_shared": ("counter", "Block bytes taken from the shared tier"),
    "tierfs_shared_bytes_from_origin": ("counter", "Block bytes fetched from the origin by "
                                        "the shared tier's path"),
}


class _LiveCollector:
    def __init__(self, source: Callable[[], Mapping[str, float]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        try:
            values = self.source()
        except Exception:  # a scrape must not fail because one figure is unavailable
            values = {}
        for name, (kind, doc) in LIVE_METRICS.items():
            if name not in values:
                continue
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, doc, value=float(values[name]))


def histogram_quantiles(
    buckets: list[tuple[float, float]], qs: tuple[float, ...] = (0.5, 0.95, 0.99)
) -> dict[str, float | None]:
    """Quantiles from cumulative (upper bound, count) buckets, interpolated
    linearly inside a bucket as Prometheus' histogram_quantile() does."""
    out: dict[str, float | None] = {}
    total = buckets[-1][1] if buckets else 0.0
    for q in qs:
        name = f"p{round(q * 100):d}"
        if total <= 0:
            out[name] = None
            continue
        rank = q * total
        lo_bound, lo_count = 0.0, 0.0
        for bound, count in buckets:
            if count >= rank:
                if math.isinf(bound):
                    out[name] = lo_bound  # beyond the last finite bucket
                else:
                    width = count - lo_count
                    frac = (rank - lo_count) / width if width else 1.0
                    out[name] = lo_bound + (bound - lo_bound) * frac
                break
            lo_bound, lo_count = bound, count
    return out


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[object, ...], Any] = {}
        r = self.registry
        self.read_bytes = Counter(
            "tierfs_read_bytes", "Bytes returned to readers, by the tier that served them",
            ["tier"], registry=r,
        )
        self.store_requests = Counter(
            "tierfs_store_requests", "Requests sent to the object store", ["op", "status"],
            registry=r,
        )
        self.store_bytes = Counter(
            "tierfs_store_bytes", "Bytes moved to/from the object store", ["op"], registry=r,
        )
        self.store_latency = Histogram(
            "tierfs_store_request_seconds", "Object store request latency", ["op"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.read_latency_seconds = Histogram(
            "tierfs_read_latency_seconds", "Latency of FUSE read requests",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.meta_ops = Counter(
            "tierfs_metadata_ops", "Metadata operations (and FLUSH requests) served", ["op"], registry=r,
        )
        self.writeback_events = Counter(
            "tierfs_writeback", "Write-back uploader events (uploaded bytes, retries)", ["event"],
            registry=r,
        )
        self.opens = Counter(
            "tierfs_opens", "File opens, by how they are served (passthrough: by the kernel "
            "from the tier-1 file; daemon) and why", ["mode", "why"], registry=r,
        )
        self.errors = Counter("tierfs_errors", "Errors returned to callers", ["kind"], registry=r)
        self.cache_bytes = Gauge("tierfs_cache_bytes", "Bytes held in tier 1", registry=r)
        self.cache_capacity = Gauge(
            "tierfs_cache_capacity_bytes", "Tier 1 size limit", registry=r,
        )

    def add_live(self, source: Callable[[], Mapping[str, float]]) -> None:
        """Expose figures owned elsewhere (see LIVE_METRICS), read at each scrape."""
        self.registry.register(_LiveCollector(source))

    def store_bytes_of(self, op: str) -> float:
        """Bytes moved by one kind of store request so far (no other figure is read)."""
        for family in self.store_bytes.collect():
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("op") == op:
                    return float(sample.value)
        return 0.0

    def read_latency_summary(self) -> dict[str, Any]:
        """p50/p95/p99 (seconds) and count of FUSE reads, from the histogram."""
        buckets: list[tuple[float, float]] = []
        count = 0.0
        total = 0.0
        for family in self.read_latency_seconds.collect():
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    buckets.append((float(s.labels["le"]), s.value))
                elif s.name.endswith("_count"):
                    count = s.value
                elif s.name.endswith("_sum"):
                    total = s.value
        buckets.sort()
        out: dict[str, Any] = {"count": int(count), "mean": total / count if count else None}
        out.update(histogram_quantiles(buckets))
        return out

    # Hooks called from the hot paths: keep them cheap.
    def _child(self, metric: _M, *labels: str) -> _M:
        """`metric.labels(*labels)`, looked up once: a warm walk through small files
        counts three ops per file, a cold one three metrics per GET, and `labels`
        takes a lock and builds a key."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def read_served(self, tier: str, nbytes: int) -> None:
        self._child(self.read_bytes, tier).inc(nbytes)

    def store_request(self, op: str, outcome: str, seconds: float, nbytes: int) -> None:
        self._child(self.store_requests, op, outcome).inc()
        if outcome == "ok":
            self._child(self.store_latency, op).observe(seconds)
            if nbytes:
                self._child(self.store_bytes, op).inc(nbytes)

    def read_latency(self, seconds: float) -> None:
        self.read_latency_seconds.observe(seconds)

    def writeback_event(self, event: str, n: int) -> None:
        """uploaded (bytes), upload_retry, quarantined, publish_conflict, streamed_parts
        (parts that went up before their file was sealed) (count)."""
        self._child(self.writeback_events, event).inc(n)

    def meta_op(self, op: str) -> None:
        self._child(self.meta_ops, op).inc()

    def file_open(self, mode: str, why: str) -> None:
        self._child(self.opens, mode, why).inc()

    def error(self, kind: str) -> None:
        self._child(self.errors, kind).inc()

    def snapshot(self) -> dict[str, object]:
        """All samples as {name{labels}: value}, for status output and tests."""
        out: dict[str, object] = {}
        for family in self.registry.collect():
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out
