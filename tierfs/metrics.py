"""Counters and histograms of one mount, and their exposition.

One prometheus_client registry per daemon; `snapshot()` turns it into the
plain dict that `tierfs status` prints, so the two can never disagree.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
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
            "tierfs_metadata_ops", "Metadata operations served", ["op"], registry=r,
        )
        self.errors = Counter("tierfs_errors", "Errors returned to callers", ["kind"], registry=r)
        self.cache_bytes = Gauge("tierfs_cache_bytes", "Bytes held in tier 1", registry=r)
        self.cache_capacity = Gauge(
            "tierfs_cache_capacity_bytes", "Tier 1 size limit", registry=r,
        )

    # Hooks called from the hot paths: keep them cheap.
    def read_served(self, tier: str, nbytes: int) -> None:
        self.read_bytes.labels(tier).inc(nbytes)

    def store_request(self, op: str, outcome: str, seconds: float, nbytes: int) -> None:
        self.store_requests.labels(op, outcome).inc()
        if outcome == "ok":
            self.store_latency.labels(op).observe(seconds)
            if nbytes:
                self.store_bytes.labels(op).inc(nbytes)

    def read_latency(self, seconds: float) -> None:
        self.read_latency_seconds.observe(seconds)

    def meta_op(self, op: str) -> None:
        self.meta_ops.labels(op).inc()

    def error(self, kind: str) -> None:
        self.errors.labels(kind).inc()

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
