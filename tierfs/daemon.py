"""Wires a mount together: one trio nursery owns every background task.

Start-up order matters for the "bad input fails fast, leaves nothing behind"
rule: everything that can be checked without mounting (source, mountpoint,
cache dir, store reachability) is checked first; only then is the FUSE mount
made, and readiness is reported once the mount answers a `stat`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from tierfs.cache import Cache, CacheBusy, CacheConflict, CacheUnwritable
from tierfs.cache.sizing import SizingError, plan
from tierfs.config import MIN_CACHE_SIZE, ConfigError, MountConfig, parse_listen_addr
from tierfs.control import ControlError, ControlServer, publish, socket_path
from tierfs.fs import TierFS
from tierfs.fusermount import MountpointError, check_mountpoint, fusermount_unmount
from tierfs.metrics import Metrics
from tierfs.namespace import Namespace
from tierfs.ops import ControlOps, relpath
from tierfs.policy import Policy
from tierfs.reader import Reader
from tierfs.sdnotify import notify
from tierfs.store import open_store
from tierfs.store.base import UNREACHABLE_KINDS, Store, StoreError
from tierfs.workers import Workers, limit_malloc_arenas
from tierfs.writeback import WriteBack

log = logging.getLogger(__name__)


class MountError(Exception):
    """A reason not to mount, shown to the user as one line."""


def set_kernel_readahead(mountpoint: Path, kb: int) -> None:
    """Ask the kernel for big FUSE reads (DESIGN §3.5); best effort."""
    dev = os.stat(mountpoint).st_dev
    path = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    try:
        path.write_text(str(kb))
    except OSError as exc:
        log.info("could not set %s to %d (%s); reads stay at the kernel default", path, kb, exc.strerror)


class Daemon:
    def __init__(self, cfg: MountConfig) -> None:
        self.cfg = cfg
        self.metrics = Metrics()
        self.store: Store | None = None
        self.cache: Cache | None = None
        self.warnings: list[str] = []
        self.start_degraded = False
        self.metrics_url: str | None = None
        self._metrics_http: Any = None
        self.writeback: WriteBack | None = None
        self.namespace: Namespace | None = None
        self.unsafe_manifests = False

    def _observe_store(self, op: str, outcome: str, seconds: float, nbytes: int) -> None:
        """Every store request: metrics, and degraded mode when any operation (an
        upload or a read, not only a listing) found the store down for a whole
        deadline; Namespace.watch_store leaves it once the store answers.
        Runs in worker threads: only a flag is set."""
        self.metrics.store_request(op, outcome, seconds, nbytes)
        ns = self.namespace
        if ns is not None and outcome in UNREACHABLE_KINDS and not ns.degraded:
            log.warning("store unreachable (%s failed: %s): degraded mode", op, outcome)
            ns.degraded = True

    def prepare(self) -> None:
        """Every check that needs no mount; raises MountError with the reason."""
        cfg = self.cfg
        try:
            self.store = open_store(
                cfg.source,
                endpoint_url=cfg.endpoint_url,
                part_size=cfg.part_size,
                max_parallel=cfg.max_parallel_puts,
                connect_timeout=cfg.connect_timeout,
                read_timeout=cfg.read_timeout,
                deadline=cfg.deadline,
                observer=self._observe_store,
                max_key_bytes=cfg.max_key_bytes,
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
                self.start_degraded = True
                log.warning("%s", msg)
            else:
                self.cache.close()
                raise MountError(str(exc)) from None
        else:
            self._check_conditional_writes()

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
            trio.run(self._main, on_ready)
        finally:
            self.stop_metrics()
            try:
                self.cache.close()
            except OSError as exc:  # a full cache disk: uses not written back are lost, no data
                log.warning("closing the cache: %s", exc)
            log.info("tierfs stopped: %s", cfg.mountpoint)

    async def _main(self, on_ready: Callable[[list[str]], None]) -> None:
        assert self.store is not None and self.cache is not None
        cfg = self.cfg
        stop = trio.Event()
        self._blocking = trio.CapacityLimiter(2)  # occasional blocking calls (unmount)
        limit_malloc_arenas()  # before the worker threads exist: bounds RSS
        workers = Workers(
            data_threads=min(cfg.max_parallel_gets, max(1, cfg.max_inflight_bytes // cfg.part_size)),
            meta_threads=16,
            disk_threads=8,
        )
        policy = Policy(cfg.rules, cfg.classes, cfg.default_class)
        ctl_path = socket_path(cfg.resolved_cache_dir())
        async with trio.open_nursery() as nursery:
            reader = Reader(
                self.store,
                workers,
                nursery,
                part_size=cfg.part_size,
                readahead_min=cfg.readahead_min,
                cache_capacity=self.cache.capacity,
                chunk_size=self.cache.chunk_size,
                observe_read=self.metrics.read_served,
                # Whole-object model prefetch leaves one GET slot to demand reads
                # elsewhere. Half the slots (2 of 4) made a cold 1 GiB safetensors
                # load_file 3.44 s, 3 of 4 3.01 s (medians of 4 alternating runs).
                prefetch_parallel=max(1, workers.data_limiter.total_tokens - 1),
                landed_bytes=cfg.max_inflight_bytes,
            )
            ops: TierFS
            ns = Namespace(
                self.store, self.cache, policy, workers,
                on_changed=lambda i: ops.invalidate(i), degraded=self.start_degraded,
            )
            wb = self.writeback = WriteBack(
                self.store, self.cache, policy, workers,
                quarantine_dir=cfg.resolved_cache_dir() / "quarantine",
                max_uploads=cfg.max_parallel_uploads,
                on_uploaded=ns.uploaded,
                conditional=not self.unsafe_manifests,
                observe=self.metrics.writeback_event,
            )
            ns.overlay = wb
            ns.on_store_back = wb.store_back
            self.namespace = ns
            nursery.start_soon(ns.watch_store)
            await wb.recover()
            nursery.start_soon(wb.run)
            ops = TierFS(
                ns,
                reader,
                self.cache,
                self.metrics,
                writeback=wb,
                prefetch_globs=cfg.prefetch_globs,
                prefetch_min_size=cfg.prefetch_min_size,
            )
            ctl_ops = ControlOps(self, ns, reader, self.cache, policy, self.metrics)
            self.metrics.add_live(ctl_ops.live_figures)
            nursery.start_soon(ctl_ops.refresh_live)
            handlers = {
                **ctl_ops.handlers(),
                "unmount": lambda req: self._request_stop(
                    stop, wb if req.get("flush") else None, lazy=bool(req.get("lazy"))
                ),
                "flush": lambda req: self._flush(wb, relpath(req.get("prefix", ""))),
                "pending": lambda req: self._pending(wb, relpath(req.get("prefix", ""))),
            }
            await nursery.start(
                ControlServer(ctl_path, handlers, ctl_ops.stream_handlers(),
                              request_errors=(StoreError,)).serve
            )
            nursery.start_soon(self._collect_orphans)
            options = set(pyfuse3.default_options)
            options |= {f"fsname=tierfs:{self.store.url}", "subtype=tierfs", "noatime"}
            if cfg.allow_other:
                options.add("allow_other")
            pyfuse3.init(ops, str(cfg.mountpoint), options)
            entry: Path | None = None
            ready = broken = False
            try:
                async with trio.open_nursery() as fuse_nursery:
                    fuse_nursery.start_soon(self._serve_fuse, stop)
                    fuse_nursery.start_soon(self._signals, stop)
                    dev = await self._wait_ready()
                    try:
                        entry = publish(dev, ctl_path)
                    except (OSError, ControlError) as exc:
                        raise MountError(f"cannot publish the control socket: {exc}") from None
                    await trio.to_thread.run_sync(
                        set_kernel_readahead, cfg.mountpoint, cfg.kernel_read_ahead_kb
                    )
                    log.info("tierfs mounted %s at %s", self.store.url, cfg.mountpoint)
                    on_ready(self.warnings)
                    ready = True
                    await stop.wait()
                    notify("STOPPING=1")
                    fuse_nursery.cancel_scope.cancel()
            except BaseException:
                broken = ready
                raise
            finally:
                # Once served, the mount is never taken away by a failure: a dead
                # daemon leaves it answering ENOTCONN (`tierfs mount` repairs it),
                # never a bare directory that silently takes the job's writes.
                if broken:
                    log.error("internal error: leaving %s dead (ENOTCONN) rather than "
                              "unmounted; `tierfs mount` again repairs it", cfg.mountpoint)
                pyfuse3.close(unmount=not broken)
                if entry is not None:
                    with contextlib.suppress(OSError):
                        entry.unlink()
                nursery.cancel_scope.cancel()

    async def _collect_orphans(self) -> None:
        """Reclaim cache files a crash left without an index record (off the start-up path)."""
        assert self.cache is not None
        try:
            removed = await trio.to_thread.run_sync(self.cache.collect_orphans)
        except OSError as exc:
            log.warning("could not look for orphaned cache files: %s", exc)
            return
        if removed:
            log.info("removed %d orphaned cache file(s)", removed)

    async def _serve_fuse(self, stop: trio.Event) -> None:
        try:
            await pyfuse3.main(min_tasks=4, max_tasks=64)
        finally:
            stop.set()

    async def _signals(self, stop: trio.Event) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                log.info("signal received: unmounting")
                stop.set()
                return

    async def _wait_ready(self) -> int:
        """The mount counts as up once a stat of its root is answered by us;
        returns the mount's device number."""
        mp = str(self.cfg.mountpoint)
        for _ in range(200):
            try:
                st = await trio.to_thread.run_sync(os.stat, mp)
                if st.st_ino == pyfuse3.ROOT_INODE:
                    return st.st_dev
            except OSError:
                pass
            await trio.sleep(0.05)
        raise MountError(f"mount at {mp} did not answer")

    async def _request_stop(
        self, stop: trio.Event, flush: WriteBack | None, *, lazy: bool
    ) -> dict[str, Any]:
        """`tierfs umount`: flush, then unmount. Not lazily unless asked: a mount
        with files open in it stays, and the caller hears "busy" (a lazy unmount
        would silently leave those processes writing into a detached tree)."""
        if flush is not None:
            await flush.flush()
        if not lazy:
            res = await trio.to_thread.run_sync(
                fusermount_unmount, self.cfg.mountpoint, limiter=self._blocking
            )
            if res.busy:
                log.info("unmount refused: %s is busy", self.cfg.mountpoint)
                return {"pid": os.getpid(), "busy": True}
            if not res.ok:  # e.g. fusermount3 missing: the lazy unmount at stop does it
                log.info("unmount of %s: %s", self.cfg.mountpoint, res.reason)
        stop.set()
        return {"pid": os.getpid()}

    async def _flush(self, wb: WriteBack, prefix: str) -> dict[str, Any]:
        await wb.flush(prefix)
        return {"pending": wb.summary(prefix)}

    async def _pending(self, wb: WriteBack, prefix: str) -> dict[str, Any]:
        return {"pending": wb.summary(prefix)}
