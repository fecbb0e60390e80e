"""The composition root: builds every part of a mount in dependency order, in one
trio nursery that owns every background task, then serves FUSE until stopped.

Each part gets what it needs at construction; nothing is patched in later, and
this is the only place that connects events to listeners (the namespace
hears what became of written files: events.py):

  workers, memory budget + buffer pools, kernel-cache notifier
  -> journal (the namespace's overlay) -> namespace -> reader
  -> queued direct writes -> read path (reads wait for them)
  -> file events -> transfer, quarantine, uploader -> barrier -> publisher
  -> tier 1 (fetches, refreshes through the read path and the namespace)
  -> lifecycle -> WriteBack, renames, recovery, pending ops
  -> tree changes -> TierFS -> control ops

`build` makes the parts of a mount without a kernel connection (the in-process
model harness drives them: tests/unit/test_model_harness.py); `serve` adds
the FUSE session, the kernel notifications and the control socket.

The store, the cache, the metrics and the store's health are made before the
mount (daemon.py), so that every check that needs no mount happens first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio

from tierfs.budget import BufferPool, MemoryBudget
from tierfs.cache import Cache, Entry
from tierfs.config import QUEUED_WRITES, RELEASE_GRACE, SERVE_BUFFERS_KEPT, MountConfig
from tierfs.control import ControlError, publish, socket_path
from tierfs.controlserver import ControlServer
from tierfs.events import FileEvent, FileEvents, Landed
from tierfs.fuse import passthrough, splice
from tierfs.fuse.fs import TierFS
from tierfs.fuse.kernel import KernelCache, set_kernel_readahead
from tierfs.fuse.modes import OpenModes
from tierfs.fuse.session import (
    NotAnswering,
    close_session,
    open_session,
    serve_requests,
    wait_ready,
)
from tierfs.fuse.tree import TreeChanges
from tierfs.health import StoreHealth
from tierfs.kept_listings import KeptListings
from tierfs.metrics import Metrics
from tierfs.namespace import Namespace
from tierfs.ops import ControlOps, MountInfo
from tierfs.policy import Policy
from tierfs.posix import Defaults
from tierfs.queued_writes import QueuedWrites
from tierfs.read.bodies import BODIES_MAX, Bodies
from tierfs.read.enginesource import EngineSource
from tierfs.read.fetcher import Fetcher, fetch_unit
from tierfs.read.handles import ReadPath
from tierfs.read.landed import LandedParts
from tierfs.read.prefetch import WholePrefetch
from tierfs.read.prepared import PreparedOpens
from tierfs.read.reader import SERVE_BUFFER, Reader
from tierfs.read.releases import Releases
from tierfs.read.shards import next_file_in
from tierfs.read.sources import Source, StoreSource
from tierfs.read.walkahead import WalkAhead
from tierfs.read.walks import Walks
from tierfs.read.warm import WarmLoads
from tierfs.read.waste import WasteCaps
from tierfs.sdnotify import notify
from tierfs.sharedtier import SharedStore, SharedTier, origin_of
from tierfs.store.base import Store, StoreError
from tierfs.store.crt import transfer_status
from tierfs.store.s3 import S3Store
from tierfs.workers import Workers, tune_malloc
from tierfs.writeback.barrier import Barrier
from tierfs.writeback.core import WriteBack
from tierfs.writeback.journal import Journal
from tierfs.writeback.lifecycle import Lifecycle
from tierfs.writeback.pendingops import PendingOps
from tierfs.writeback.publish import Publisher
from tierfs.writeback.quarantine import Conflicts, Quarantine
from tierfs.writeback.records import BarrierRecords, StreamRecords
from tierfs.writeback.recovery import Recovery
from tierfs.writeback.rename import Renames
from tierfs.writeback.streaming import Streams
from tierfs.writeback.tier1 import Tier1
from tierfs.writeback.transfer import Transfer
from tierfs.writeback.uploader import Uploader

log = logging.getLogger(__name__)


class MountError(Exception):
    """A reason not to mount, shown to the user as one line."""


@dataclass
class Prepared:
    """What exists before the mount: made and checked by Daemon.prepare."""

    cfg: MountConfig
    store: Store
    cache: Cache
    metrics: Metrics
    health: StoreHealth
    warnings: list[str]
    conditional: bool  # the store enforces conditional writes (manifests publish with them)
    metrics_url: str | None
    shared: SharedStore | None = None  # the shared tier's store, where one is configured


@dataclass
class Parts:
    """A mount's parts, built and running, short of the kernel's connection."""

    ops: TierFS
    ns: Namespace
    journal: Journal
    uploader: Uploader
    pending: PendingOps
    ctl: ControlOps
    modes: OpenModes
    kernel: KernelCache
    workers: Workers
    cache: Cache


async def build(p: Prepared, nursery: trio.Nursery, stop: trio.Event) -> Parts:
    """Make every part of a mount in `nursery`, start their background tasks and
    recover what a restart left; the kernel's side (notifications, the FUSE
    session, the control socket) is `serve`'s."""
    cfg, store, cache, metrics, health = p.cfg, p.store, p.cache, p.metrics, p.health
    data_slots = min(cfg.max_parallel_gets, max(1, cfg.inflight_bytes // cfg.part_size))
    workers = Workers(data=data_slots, upload=cfg.max_parallel_puts,
                      meta=cfg.meta_threads, disk=cfg.disk_threads, small=cfg.max_parallel_gets)
    policy = Policy(cfg.rules, cfg.classes, cfg.default_class)
    cache_dir = cfg.resolved_cache_dir()
    budget = MemoryBudget(cfg.memory_budget)
    # Reads' part buffers (GETs in flight, landed, staged), their replies, and
    # uploads' part buffers, whose share of the budget is capped: uploads
    # never take the memory reads need.
    parts = BufferPool(budget, cfg.part_size,
                       keep=data_slots + cfg.inflight_bytes // cfg.part_size)
    serve_buffers = BufferPool(budget, SERVE_BUFFER, keep=SERVE_BUFFERS_KEPT)
    upload_parts = BufferPool(budget, cfg.part_size, keep=cfg.max_parallel_puts,
                              cap=cfg.max_parallel_puts * cfg.part_size, exact=True)
    kernel = KernelCache()
    journal = Journal()
    defaults = Defaults(
        uid=os.getuid() if cfg.uid is None else cfg.uid,
        gid=os.getgid() if cfg.gid is None else cfg.gid,
        file_mode=cfg.file_mode, dir_mode=cfg.dir_mode)
    kept = KeptListings(cache, workers)
    ns = Namespace(store, cache, policy, workers, health=health, kept=kept, overlay=journal,
                   on_changed=kernel.drop_pages, on_gone=kernel.drop_name,
                   defaults=defaults)
    shared = None if p.shared is None else SharedTier(
        p.shared.store, **origin_of(cfg.source), block=cfg.shared_block_size,
        lease=cfg.shared_lease, origin_fetches=cfg.shared_origin_fetches,
        conditional=p.shared.conditional, secret=p.shared.secret,
        budget=budget, meta=workers.meta, data=workers.data, upload=workers.upload)
    if shared is not None:
        metrics.add_live(shared.figures)
    # The origin: through the transfer engine into tier 1 where the store has one.
    origin: Source = (EngineSource(store, cache.chunk_size)
                      if isinstance(store, S3Store) and store.engine is not None
                      else StoreSource(store))
    bodies = Bodies(budget, min(BODIES_MAX, cfg.memory_budget // 8))
    fetcher = Fetcher(
        [*([shared] if shared is not None else []), origin], workers, nursery,
        cache=cache, budget=budget, parts=parts,
        landed=LandedParts(parts, cfg.inflight_bytes), bodies=bodies,
        waste=WasteCaps(cache.capacity),
        unit=fetch_unit(cfg.part_size, cache.capacity, cache.chunk_size),
        whole_max=cfg.whole_object_max, learned=ns.learn)
    reader = Reader(fetcher, workers, nursery, serve=serve_buffers,
                    readahead_min=cfg.readahead_min, observe_read=metrics.read_served,
                    lend=splice.decide(cfg.splice))
    queued = QueuedWrites(nursery, _apply_write(workers), QUEUED_WRITES, budget)
    walk_ahead = WalkAhead(fetcher, health, children=ns.children_of,
                           stored=ns.stored_file, whole_max=cfg.whole_object_max,
                           parallel=max(1, cfg.max_parallel_gets - 1), walks=Walks())
    modes = OpenModes(passthrough.probe(cache_dir, cfg.passthrough), cache, workers,
                      nursery, metrics.file_open)
    warm = WarmLoads(cache, bodies, whole_max=cfg.whole_object_max,
                     kernel_reads=lambda: modes.mode.enabled)
    releases = Releases(cache, workers)
    reads = ReadPath(
        reader, cache, workers, health, walk_ahead=walk_ahead,
        prepared=PreparedOpens(cache, workers, warm, releases, walk_ahead), warm=warm,
        releases=releases,
        # Whole-object model prefetch leaves one GET slot to demand reads
        # elsewhere. Half the slots (2 of 4) made a cold 1 GiB safetensors
        # load_file 3.44 s, 3 of 4 3.01 s (medians of 4 alternating runs).
        # Through a shared tier, the next shard of a model is fetched ahead
        # (read/prefetch.py), with no more parts in flight than the node has
        # origin slots until its reader opens it.
        prefetch=WholePrefetch(
            fetcher, cache, workers, nursery, parallel=max(1, data_slots - 1),
            globs=cfg.prefetch_globs, min_size=cfg.prefetch_min_size,
            next_file=(next_file_in(ns.children_of, ns.stored_file)
                       if shared is not None and cfg.shared_claim_ahead else None),
            ahead_parallel=cfg.shared_origin_fetches + 1),
        observe_latency=metrics.read_latency, queued=queued, refresh=ns.refresh)

    # The write path; what becomes of written files is the namespace's to show.
    events = FileEvents()
    events.subscribe(partial(_namespace_hears, ns))
    quarantine = Quarantine(cache_dir / "quarantine", cache)
    conflicts = Conflicts(cache_dir / "conflicts", cache)
    barrier_records = BarrierRecords(cache_dir / "publish")
    streams = Streams(store, cache, workers, upload_parts, queued,
                      StreamRecords(cache_dir / "streams"), nursery,
                      part_size=cfg.part_size, parallel=cfg.max_parallel_puts)
    transfer = Transfer(store, workers, upload_parts, streams, part_size=cfg.part_size,
                        parallel_parts=cfg.max_parallel_puts, observe=metrics.writeback_event)
    uploader = Uploader(transfer, cache, journal, quarantine, conflicts, barrier_records,
                        workers, health, streams, events, max_files=cfg.max_parallel_uploads,
                        observe=metrics.writeback_event)
    barrier = Barrier(
        journal, partial(workers.disk, lambda: quarantine.notes() + conflicts.notes()),
        hurry=uploader.hurry, release_grace=RELEASE_GRACE,
        staged=lambda key: policy.settings(key).name == "staged")
    publisher = Publisher(uploader, transfer, barrier, journal, conflicts, barrier_records,
                          workers, nursery, conditional=p.conditional,
                          observe=metrics.writeback_event)
    tier1 = Tier1(cache, workers, fetch=partial(fetcher.ensure, in_parts=True),
                  refresh=ns.refresh)
    life = Lifecycle(journal, tier1, policy, health, uploader, transfer, publisher, streams,
                     events)
    wb = WriteBack(journal, life, tier1, store, workers, policy, queued, read=reads.read,
                   invalidate=kernel.drop_pages)
    renames = Renames(wb, journal, life, tier1, store, workers, queued)
    pending = PendingOps(journal, life, barrier, quarantine, conflicts, workers)
    ops = TierFS(ns, reads, wb, TreeChanges(ns, wb, renames), metrics, workers, cache.root,
                 modes)
    info = MountInfo(
        source=store.url, mountpoint=str(cfg.mountpoint), cache_dir=str(cache_dir),
        config_file=str(cfg.config_file) if cfg.config_file else None,
        classes=cfg.classes, rules=cfg.rules, default_class=cfg.default_class,
        metrics_url=p.metrics_url)
    def read_modes() -> dict[str, object]:
        """How reads are answered: the kernel from tier 1 (passthrough), and libfuse
        from tier-1 files (splice: reads answered so)."""
        return {**modes.summary(), "splice": reader.lend, "spliced_reads": reader.lent}

    ctl = ControlOps(info, ns, fetcher, cache, policy, metrics, workers, health, pending, budget,
                     read_modes, stop,
                     transfers=partial(transfer_status, getattr(store, "engine", None)))
    metrics.add_live(ctl.live_figures)

    nursery.start_soon(health.watch, partial(workers.meta, store.check))
    nursery.start_soon(kept.run)
    nursery.start_soon(ns.objects.run)
    nursery.start_soon(cache.evictor.run, workers.disk)  # eviction beside the fills
    nursery.start_soon(walk_ahead.run)
    nursery.start_soon(reads.run)
    await Recovery(journal, cache, policy, workers, quarantine, uploader, publisher,
                   streams).recover()
    nursery.start_soon(uploader.run)
    nursery.start_soon(ctl.refresh_live)
    return Parts(ops=ops, ns=ns, journal=journal, uploader=uploader, pending=pending, ctl=ctl,
                 modes=modes, kernel=kernel, workers=workers, cache=cache)


async def serve(p: Prepared, on_ready: Callable[[list[str]], None]) -> None:
    """Build the parts, mount, serve until unmounted or `stop`, clean up."""
    cfg, store, cache = p.cfg, p.store, p.cache
    tune_malloc()  # before the worker threads exist: bounds RSS
    cache_dir = cfg.resolved_cache_dir()
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        m = await build(p, nursery, stop)
        workers, modes = m.workers, m.modes
        nursery.start_soon(m.kernel.run)
        ctl_path = socket_path(cache_dir)
        await nursery.start(ControlServer(ctl_path, m.ctl.handlers(), m.ctl.stream_handlers(),
                                          request_errors=(StoreError,)).serve)
        nursery.start_soon(_collect_orphans, cache, workers)
        open_session(m.ops, cfg.mountpoint, fsname=f"tierfs:{store.url}",
                     allow_other=cfg.allow_other)
        entry: Path | None = None
        ready = broken = False
        try:
            async with trio.open_nursery() as fuse_nursery:
                fuse_nursery.start_soon(serve_requests, stop)
                fuse_nursery.start_soon(_signals, stop)
                try:
                    dev = await wait_ready(cfg.mountpoint, workers)
                    entry = await workers.disk(publish, dev, ctl_path)
                except NotAnswering as exc:
                    raise MountError(str(exc)) from None
                except (OSError, ControlError) as exc:
                    raise MountError(f"cannot publish the control socket: {exc}") from None
                await workers.disk(set_kernel_readahead, cfg.mountpoint, cfg.kernel_read_ahead_kb)
                modes.set_mode(await workers.disk(passthrough.confirm, modes.mode,
                                                  cache.objects_dir))
                log.info("FUSE passthrough: %s", modes.mode)
                log.info("tierfs mounted %s at %s", store.url, cfg.mountpoint)
                on_ready(p.warnings)
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
            close_session(unmount=not broken)
            if entry is not None:
                with contextlib.suppress(OSError):
                    entry.unlink()
            nursery.cancel_scope.cancel()


async def _namespace_hears(ns: Namespace, event: FileEvent) -> None:
    """What became of a written file, as the namespace shows it: a landed file
    takes the store's attributes; a dropped one, or a manifest that lost its
    race, shows what the store has (or goes, if the store never had it)."""
    if isinstance(event, Landed):
        await ns.uploaded(event.key, event.info)
    else:
        ns.local_dropped(event.key)


def _apply_write(workers: Workers) -> Callable[[Entry, int, bytes], Awaitable[None]]:
    """How a queued direct write reaches tier 1: entry.local.write in a disk worker."""

    async def apply(entry: Entry, offset: int, data: bytes) -> None:
        await workers.disk(entry.local.write, offset, data)

    return apply


async def _collect_orphans(cache: Cache, workers: Workers) -> None:
    """Reclaim cache files a crash left without an index record (off the start-up path)."""
    try:
        removed = await workers.disk(cache.collect_orphans)
    except OSError as exc:
        log.warning("could not look for orphaned cache files: %s", exc)
        return
    if removed:
        log.info("removed %d orphaned cache file(s)", removed)


async def _signals(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            log.info("signal received: unmounting")
            stop.set()
            return
