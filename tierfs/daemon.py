"""Process life of a mount: start-up checks, the metrics endpoint, the trio run.

Start-up order matters for the "bad input fails fast, leaves nothing behind"
rule: everything that can be checked without mounting (source, mountpoint,
cache dir and its size, store reachability) is checked first (`prepare`);
only then does mount.py build the rest and make the FUSE mount, and readiness
is reported once the mount answers a `stat`.
"""

from __future__ import annotations

import gc
import logging
import os
import resource
from collections.abc import Callable
from typing import Any

import trio

from tierfs.cache import Cache, CacheBusy, CacheConflict, CacheUnwritable
from tierfs.cache.sizing import SizingError, plan
from tierfs.config import (
    DEGRADED_RETRY,
    MIN_CACHE_SIZE,
    ConfigError,
    MountConfig,
    parse_listen_addr,
)
from tierfs.fuse.fusermount import MountpointError, check_mountpoint
from tierfs.health import StoreHealth
from tierfs.metrics import Metrics
from tierfs.mount import MountError, Prepared, serve
from tierfs.sharedtier import SharedStore, open_shared
from tierfs.store import open_store
from tierfs.store.base import UNREACHABLE_KINDS, Store, StoreError

log = logging.getLogger(__name__)

__all__ = ["Daemon", "MountError"]


class Daemon:
    def __init__(self, cfg: MountConfig) -> None:
        self.cfg = cfg
        self.metrics = Metrics()
        self.store: Store | None = None
        self.cache: Cache | None = None
        self.warnings: list[str] = []
        self.health = StoreHealth(probe_every=DEGRADED_RETRY)
        self.metrics_url: str | None = None
        self._metrics_http: Any = None
        self.unsafe_manifests = False
        self.shared: SharedStore | None = None

    def _observe_store(self, op: str, outcome: str, seconds: float, nbytes: int) -> None:
        """Every store request (worker threads): metrics, and degraded mode when any
        operation (an upload or a read, not only a listing) found the store down."""
        self.metrics.store_request(op, outcome, seconds, nbytes)
        self.health.observe(op, outcome)

    def _observe_shared(self, op: str, outcome: str, seconds: float, nbytes: int) -> None:
        """Shared-tier requests: counted apart (shared_get, ...), never degraded mode
        (the origin serves while the shared tier is away)."""
        self.metrics.store_request(f"shared_{op}", outcome, seconds, nbytes)

    def prepare(self) -> None:
        """Every check that needs no mount; raises MountError with the reason."""
        cfg = self.cfg
        _open_files_up_to_hard_limit()
        try:
            # Connections: data and small-object GETs (max_parallel_gets each), puts, metadata.
            self.store = open_store(
                cfg.source,
                endpoint_url=cfg.endpoint_url,
                part_size=cfg.part_size,
                max_connections=2 * cfg.max_parallel_gets + cfg.max_parallel_puts + cfg.meta_threads,
                connect_timeout=cfg.connect_timeout,
                read_timeout=cfg.read_timeout,
                deadline=cfg.deadline,
                observer=self._observe_store,
                max_key_bytes=cfg.max_key_bytes,
                engine=cfg.store_engine,
            )
        except StoreError as exc:
            raise MountError(str(exc)) from None
        try:
            check_mountpoint(cfg.mountpoint, nonempty=cfg.nonempty)
        except MountpointError as exc:
            raise MountError(str(exc)) from None
        cache_dir = cfg.resolved_cache_dir()
        try:
            cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Sized below, once the cache says what it already holds.
            self.cache = Cache(cache_dir, capacity=MIN_CACHE_SIZE, chunk_size=cfg.chunk_size,
                               min_free=0)
        except CacheBusy:
            hint = "" if cfg.cache_dir else "; pass --cache-dir to use another"
            raise MountError(
                f"cache dir {cache_dir} is in use by another tierfs mount{hint}"
            ) from None
        except CacheUnwritable as exc:
            raise MountError(str(exc)) from None
        except OSError as exc:
            raise MountError(f"cache dir {cache_dir} is not usable: {exc.strerror}") from None
        try:
            had_data = self.cache.bind(self.store.identity)
            st = os.statvfs(cache_dir)
            sizes = plan(str(cache_dir), st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize,
                         self.cache.stats().used_bytes, size=cfg.cache_size,
                         min_free=cfg.min_free)
        except (CacheConflict, SizingError) as exc:
            self.cache.close()
            raise MountError(str(exc)) from None
        self.cache.set_limits(sizes.capacity, sizes.min_free)
        if sizes.warning:
            self.warnings.append(sizes.warning)
            log.warning("%s", sizes.warning)
        self.metrics.cache_capacity.set(sizes.capacity)
        try:
            self.store.check()
        except StoreError as exc:
            if exc.kind in UNREACHABLE_KINDS and had_data:
                msg = f"{exc}; mounting in degraded mode from the cache in {cache_dir}"
                self.warnings.append(msg)
                self.health.mark_down(str(exc))
                log.warning("%s", msg)
            else:
                self.cache.close()
                raise MountError(str(exc)) from None
        else:
            self._check_conditional_writes()
        if cfg.shared_cache is not None:
            try:
                self.shared = open_shared(
                    cfg, self._observe_shared,
                    max_connections=2 * cfg.max_parallel_gets + cfg.max_parallel_puts
                    + cfg.meta_threads)
            except (ConfigError, StoreError) as exc:
                self.cache.close()
                raise MountError(str(exc)) from None
            self.warnings.extend(self.shared.warnings)

    def _check_conditional_writes(self) -> None:
        """Manifests rely on If-Match / If-None-Match: * being enforced; probe once."""
        assert self.store is not None and self.cache is not None
        cfg = self.cfg
        publishing = [c.name for c in cfg.classes.values() if c.write_mode == "publish"]
        if not publishing:
            return
        try:
            ok = self.store.probe_conditional_put()
        except StoreError as exc:
            self.warnings.append(f"could not probe conditional writes ({exc}); "
                                 "manifest publishing will fail if the store ignores them")
            return
        if ok:
            return
        if not cfg.allow_unsafe_manifests:
            self.cache.close()
            raise MountError(
                f"{self.store.url} does not enforce conditional writes (If-Match / "
                f"If-None-Match), which the {', '.join(publishing)} class needs; pass "
                "--allow-unsafe-manifests to publish with plain PUTs"
            )
        self.warnings.append("store ignores conditional writes: manifests publish unconditionally")
        self.unsafe_manifests = True

    def start_metrics(self) -> None:
        """Serve Prometheus text on cfg.metrics_addr from a daemon thread (dies
        with the process); call after prepare(). MountError if it cannot bind."""
        if not self.cfg.metrics_addr:
            return
        from prometheus_client import start_http_server

        try:
            host, port = parse_listen_addr(self.cfg.metrics_addr, self.cfg.metrics_allow_remote)
            server, _ = start_http_server(port, addr=host, registry=self.metrics.registry)
        except ConfigError as exc:
            raise MountError(str(exc)) from None
        except OSError as exc:
            raise MountError(
                f"cannot serve metrics on {self.cfg.metrics_addr}: {exc.strerror or exc}"
            ) from None
        self._metrics_http = server
        self.metrics_url = f"http://{self.cfg.metrics_addr}/metrics"
        log.info("metrics at %s", self.metrics_url)

    def stop_metrics(self) -> None:
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None

    def run(self, on_ready: Callable[[list[str]], None]) -> None:
        """Mount, serve until unmounted or signalled, then clean up."""
        assert self.store is not None and self.cache is not None
        cfg = self.cfg
        try:
            self.start_metrics()
            prepared = Prepared(cfg, self.store, self.cache, self.metrics, self.health,
                                self.warnings, not self.unsafe_manifests, self.metrics_url,
                                self.shared)
            _collect_garbage_less_often()
            trio.run(serve, prepared, on_ready)
        finally:
            self.stop_metrics()
            try:
                self.cache.close()
            except OSError as exc:  # a full cache disk: uses not written back are lost, no data
                log.warning("closing the cache: %s", exc)
            log.info("tierfs stopped: %s", cfg.mountpoint)


# Allocations between two young-generation collections (CPython's default: 700).
GC_YOUNG_THRESHOLD = 20_000


def _collect_garbage_less_often() -> None:
    """The daemon holds a node per name it has seen (10,000s in a dataset) and makes
    thousands of objects per directory listed. At CPython's default threshold the
    cyclic collector ran ~95 times over three `ls -l` of 10,000 names after a
    remount, 55-70 ms in all as its older generations walked every node: the
    second `ls -l` took 0.12-0.16 s, the third 0.07 s. Young collections waiting
    for 20,000 allocations: the second 0.07 s, the first 0.147 -> 0.138 s (medians
    of 7). Garbage waits a little longer: a few MB at most."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def _open_files_up_to_hard_limit() -> None:
    """A mount holds cache files, store connections and handles the kernel keeps
    open for its users: a 1024 soft limit (a shell's or a CI runner's default) is
    reached by a busy node. The hard limit is the administrator's word; take it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.warning("open-files limit stays at %d: %s", soft, exc)
