"""Control-socket operations of a running mount (DESIGN §7).

`status`, `flush`, `unmount`, `pending`, `warmup`, `cache ls|evict|verify|stats`
and `policy` are answered here; mount.py registers them on the control socket.
Every cache and index call runs in a worker thread, never on the trio loop.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from tierfs.budget import MemoryBudget
from tierfs.cache import Cache, Entry
from tierfs.config import ClassSettings
from tierfs.control import Emit
from tierfs.fuse.fusermount import fusermount_unmount
from tierfs.health import StoreHealth
from tierfs.metrics import Metrics
from tierfs.namespace import ROOT_INODE, Namespace, Node
from tierfs.policy import Policy
from tierfs.read.fetcher import Fetcher
from tierfs.store.base import StoreError
from tierfs.workers import Workers
from tierfs.writeback.pendingops import PendingOps

log = logging.getLogger(__name__)

PROGRESS_INTERVAL = 0.25  # seconds between warmup progress lines
MAX_WARMUP_PARALLEL = 64
LIVE_EVERY = 1.0  # seconds between refreshes of the figures the metrics scrape reads


@dataclass(frozen=True)
class MountInfo:
    """What status shows about the mount itself."""

    source: str
    mountpoint: str
    cache_dir: str
    config_file: str | None
    classes: dict[str, ClassSettings]
    rules: tuple[tuple[str, str], ...]
    default_class: str
    metrics_url: str | None


def _jsonable(v: Any) -> Any:
    """inf/nan are not JSON: spell them as strings ('inf' is also what configs accept)."""
    if isinstance(v, float) and not math.isfinite(v):
        return "inf" if v > 0 else str(v)
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def relpath(path: Any) -> str:
    """A request's path, relative to the mount root ('' for the root itself)."""
    if not isinstance(path, str):
        raise ValueError("path must be a string")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"path {path!r} must not contain '..'")
    return "/".join(parts)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


class ControlOps:
    def __init__(
        self,
        info: MountInfo,
        ns: Namespace,
        fetcher: Fetcher,
        cache: Cache,
        policy: Policy,
        metrics: Metrics,
        workers: Workers,
        health: StoreHealth,
        writeback: PendingOps,
        budget: MemoryBudget,
        passthrough: Callable[[], dict[str, Any]],
        stop: trio.Event,
        transfers: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.info = info
        self.ns = ns
        self.fetcher = fetcher
        self.cache = cache
        self.policy = policy
        self.metrics = metrics
        self.workers = workers
        self.health = health
        self.wb = writeback
        self.budget = budget
        self.passthrough = passthrough  # the mount's mode, why, inodes open that way
        self.stop = stop
        self.transfers = transfers  # the store's engine, its bytes, CPU by thread kind
        # Figures owned by trio-side objects, refreshed by `refresh_live` and read
        # by the metrics scrape thread (which must not call into them itself).
        self._live: dict[str, float] = {}
        # tier-1 usage is the cache's own figure, read at scrape time
        metrics.cache_bytes.set_function(lambda: cache.stats().used_bytes)

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]]:
        return {
            "status": self.status,
            "pending": self.pending,
            "pending_list": self.pending_list,
            "pending_discard": self.pending_discard,
            "pending_retry": self.pending_retry,
            "cache_ls": self.cache_ls,
            "cache_evict": self.cache_evict,
            "cache_verify": self.cache_verify,
            "cache_stats": self.cache_stats,
            "policy": self.classify,
        }

    def stream_handlers(self) -> dict[str, Callable[[dict[str, Any], Emit], Awaitable[dict[str, Any]]]]:
        return {"warmup": self.warmup, "flush": self.flush, "unmount": self.unmount}

    # -- uploads ------------------------------------------------------------------------

    def _pending_figures(self, prefix: str = "") -> dict[str, Any]:
        return {"available": True, **self.wb.summary(prefix)}

    async def pending(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"pending": self._pending_figures(relpath(req.get("prefix", "")))}

    async def flush(self, req: dict[str, Any], emit: Emit) -> dict[str, Any]:
        """The barrier over PREFIX: progress lines while it waits, then its outcome."""
        prefix = relpath(req.get("prefix", ""))
        stall = req.get("stall")
        key = f"{prefix}/" if prefix and not await self._is_file(prefix) else prefix
        outcome = await self.wb.flush(
            key, stall=float(stall) if stall is not None else None,
            progress=lambda p: emit({"event": "waiting", **p}))
        # then what the uploads told the directories' attribute objects
        await self.ns.settle(key if key.endswith("/") else key.rpartition("/")[0] + "/"
                             if "/" in key else "")
        return {"flush": outcome.asdict(), "pending": self._pending_figures(prefix)}

    async def unmount(self, req: dict[str, Any], emit: Emit) -> dict[str, Any]:
        """`tierfs umount`: flush (unless told not to), then unmount, then stop. A
        failed or abandoned flush leaves the mount up. Not lazily unless asked: a
        mount with files open in it stays, and the caller hears "busy" (a lazy
        unmount would silently leave those processes writing into a detached tree)."""
        out: dict[str, Any] = {"pid": os.getpid()}
        if req.get("flush", True):
            result = await self.flush(req, emit)
            out.update(result)
            if not result["flush"]["ok"]:
                out["stopped"] = False
                return out
        if not req.get("lazy"):
            res = await self.workers.disk(fusermount_unmount, Path(self.info.mountpoint))
            if res.busy:
                log.info("unmount refused: %s is busy", self.info.mountpoint)
                out.update(busy=True, stopped=False)
                return out
            if not res.ok:  # e.g. fusermount3 missing: the lazy unmount at stop does it
                log.info("unmount of %s: %s", self.info.mountpoint, res.reason)
        self.stop.set()
        out["stopped"] = True
        return out

    async def _is_file(self, rel: str) -> bool:
        try:
            return not (await self.resolve(rel)).is_dir
        except (OSError, StoreError):
            return False

    async def pending_list(self, req: dict[str, Any]) -> dict[str, Any]:
        return await self.wb.pending(relpath(req.get("prefix", "")))

    async def pending_discard(self, req: dict[str, Any]) -> dict[str, Any]:
        return await self._each_key(req, self.wb.discard)

    async def pending_retry(self, req: dict[str, Any]) -> dict[str, Any]:
        return await self._each_key(req, self.wb.retry)

    async def _each_key(
        self, req: dict[str, Any], act: Callable[[str], Awaitable[str]]
    ) -> dict[str, Any]:
        paths = req.get("paths")
        if not isinstance(paths, list) or not paths:
            raise ValueError("give at least one path")
        done, failed = [], []
        for p in paths:
            key = relpath(p)
            try:
                done.append({"key": key, "result": await act(key)})
            except (OSError, ValueError, StoreError) as exc:
                failed.append({"key": key, "error": str(exc) if not isinstance(exc, OSError)
                               else exc.strerror or str(exc)})
        return {"done": done, "failed": failed}

    # -- figures -------------------------------------------------------------------

    def quarantined_files(self) -> int:
        """Files kept aside, never uploaded: <cache>/quarantine/ (one .json note
        per file, written by the write path) and rejected conditional PUTs in
        <cache>/conflicts/. Blocking (a directory scan)."""
        n = 0
        for sub, want in (("quarantine", ".json"), ("conflicts", "")):
            try:
                with os.scandir(self.cache.root / sub) as it:
                    n += sum(1 for de in it if de.name.endswith(want) and de.is_file())
            except OSError:
                pass
        return n

    def live_figures(self) -> dict[str, float]:
        """For the metrics scrape thread: thread-safe sources only."""
        st = self.cache.stats()
        out: dict[str, float] = {
            "tierfs_cache_objects": st.objects,
            "tierfs_cache_open_objects": st.open_objects,
            "tierfs_evictions": st.evictions_total,
            "tierfs_evicted_bytes": st.evicted_bytes_total,
            "tierfs_corrupt_chunks": st.corrupt_chunks_total,
        }
        out.update(self._live)
        return out

    async def refresh_live(self) -> None:
        """Keep the scrape-side copy of trio-owned figures fresh (runs in the nursery)."""
        while True:
            pending = self.wb.summary()
            live = {
                "tierfs_pending_uploads": float(pending["count"]),  # type: ignore[arg-type]
                "tierfs_pending_upload_bytes": float(pending["bytes"]),  # type: ignore[arg-type]
                "tierfs_quarantined_files": float(
                    await self.workers.disk(self.quarantined_files)),
            }
            if pending["count"]:
                live["tierfs_pending_upload_oldest_seconds"] = float(pending["oldest_age_s"])  # type: ignore[arg-type]
            self._live = live
            await trio.sleep(LIVE_EVERY)

    async def status(self, req: dict[str, Any]) -> dict[str, Any]:
        info = self.info
        stats = await self.workers.disk(self.cache.stats)
        pending = self._pending_figures()
        notes = [dataclasses.asdict(n) for n in await self.wb.notes()]
        quarantined = {
            "count": await self.workers.disk(self.quarantined_files),
            "files": notes,
        }
        snap = await self.workers.disk(self.metrics.snapshot)  # reads the index (cache stats)

        def labelled(prefix: str) -> dict[str, dict[str, float]]:
            """{'op=get,status=ok': v} samples of one family -> nested by label."""
            out: dict[str, Any] = {}
            for k, v in snap.items():
                if k.startswith(prefix + "{"):
                    labels = dict(p.split("=", 1) for p in k[len(prefix) + 1 : -1].split(","))
                    out[",".join(f"{a}={b}" for a, b in labels.items())] = v
            return out

        cache_b = float(snap.get("tierfs_read_bytes_total{tier=cache}", 0.0))  # type: ignore[arg-type]
        store_b = float(snap.get("tierfs_read_bytes_total{tier=store}", 0.0))  # type: ignore[arg-type]
        requests: dict[str, dict[str, int]] = {}
        for k, v in labelled("tierfs_store_requests_total").items():
            lab = dict(p.split("=", 1) for p in k.split(","))
            requests.setdefault(lab.get("op", "?"), {})[lab.get("status", "?")] = int(v)  # type: ignore[call-overload]
        errors = {k.split("=", 1)[1]: int(v) for k, v in labelled("tierfs_errors_total").items()}  # type: ignore[call-overload]
        opens: dict[str, dict[str, int]] = {}
        for k, v in labelled("tierfs_opens_total").items():
            lab = dict(p.split("=", 1) for p in k.split(","))
            opens.setdefault(lab.get("mode", "?"), {})[lab.get("why", "?")] = int(v)  # type: ignore[call-overload]
        return _jsonable({
            "pid": os.getpid(),
            "source": info.source,
            "mountpoint": info.mountpoint,
            "cache_dir": info.cache_dir,
            "config_file": info.config_file,
            "degraded": self.health.degraded,
            "cache": {
                "used_bytes": stats.used_bytes,
                "capacity_bytes": stats.capacity,
                "objects": stats.objects,
                "open_objects": stats.open_objects,
                "evictions": stats.evictions_total,
                "evicted_bytes": stats.evicted_bytes_total,
                "corrupt_chunks": stats.corrupt_chunks_total,
            },
            "classes": {n: dataclasses.asdict(s) for n, s in info.classes.items()},
            "rules": [{"glob": g, "class": c} for g, c in info.rules],
            "default_class": info.default_class,
            "reads": {
                "cache_bytes": int(cache_b),
                "store_bytes": int(store_b),
                "total_bytes": int(cache_b + store_b),
                "hit_ratio": cache_b / (cache_b + store_b) if cache_b + store_b else None,
            },
            "store": {
                "get_bytes": int(snap.get("tierfs_store_bytes_total{op=get}", 0.0)),  # type: ignore[call-overload]
                "put_bytes": int(snap.get("tierfs_store_bytes_total{op=put}", 0.0)),  # type: ignore[call-overload]
                "requests": requests,
                **(self.transfers() if self.transfers is not None else {}),
            },
            "pending": pending,
            "quarantined": quarantined,
            "memory": {"budget": self.budget.limit, "used": self.budget.used,
                       "peak": self.budget.peak},
            "passthrough": {**self.passthrough(), "opens": opens},
            "read_latency": self.metrics.read_latency_summary(),
            "errors": errors,
            "metrics_addr": info.metrics_url,
            "metrics": snap,
        })

    # -- paths -----------------------------------------------------------------------

    async def resolve(self, rel: str) -> Node:
        """Walk Namespace.lookup from the root, one component at a time."""
        node = self.ns.get(ROOT_INODE)
        for part in rel.split("/") if rel else ():
            child = await self.ns.lookup(node.inode, part)
            # lookup() counts a kernel reference; this one is ours, not the kernel's
            child.lookups = max(0, child.lookups - 1)
            node = child
        return node

    async def _walk(self, node: Node, out: list[Node], failed: list[dict[str, str]]) -> None:
        try:
            children = await self.ns.readdir(node.inode)
        except (OSError, StoreError) as exc:
            failed.append({"path": node.path or "/", "error": _reason(exc)})
            return
        for _, child in children:
            if child.is_dir:
                await self._walk(child, out, failed)
            else:
                out.append(child)

    # -- warmup ------------------------------------------------------------------------

    async def warmup(self, req: dict[str, Any], emit: Emit) -> dict[str, Any]:
        """Fetch files (or whole trees with recursive) into tier 1, N at a time,
        sending a progress line every PROGRESS_INTERVAL."""
        paths = req.get("paths")
        if not isinstance(paths, list) or not paths:
            raise ValueError("warmup needs a non-empty list of paths")
        recursive = bool(req.get("recursive", False))
        parallel = max(1, min(int(req.get("parallel", 4)), MAX_WARMUP_PARALLEL))
        started = time.monotonic()
        failed: list[dict[str, str]] = []
        files: list[Node] = []
        for p in paths:
            try:
                rel = relpath(p)
                node = await self.resolve(rel)
            except (OSError, StoreError, ValueError) as exc:
                failed.append({"path": str(p), "error": _reason(exc)})
                continue
            if node.is_dir:
                if recursive:
                    await self._walk(node, files, failed)
                else:
                    failed.append({"path": rel or "/", "error": "is a directory (use --recursive)"})
            else:
                files.append(node)
        files = list({n.inode: n for n in files}.values())  # each file once
        total = sum(n.size for n in files)
        get_before = self._fetched_bytes()
        done = {"bytes": 0, "files": 0}
        active: dict[int, Entry] = {}
        await emit({"event": "start", "files": len(files), "bytes": total})

        def progress_now() -> dict[str, Any]:
            partial = 0
            for e in list(active.values()):
                partial += e.size - sum(b - a for a, b in e.serve.missing(0, e.size))
            return {
                "event": "progress",
                "done_bytes": done["bytes"] + partial,
                "bytes": total,
                "done_files": done["files"],
                "files": len(files),
                "failed": len(failed),
                "elapsed": time.monotonic() - started,
            }

        async def one(node: Node) -> None:
            if node.size > self.cache.capacity:
                failed.append({"path": node.path, "error": (
                    f"larger ({node.size} B) than the tier-1 limit ({self.cache.capacity} B)")})
                done["bytes"] += node.size
                return
            try:
                if node.settings.revalidate_on_open:
                    await self.ns.revalidate(node)
                entry = await self.workers.disk(
                    self.cache.open, node.path, node.etag, node.size, node.mtime
                )
            except (OSError, StoreError) as exc:
                failed.append({"path": node.path, "error": _reason(exc)})
                done["bytes"] += node.size
                return
            active[node.inode] = entry
            try:
                await self.fetcher.ensure(entry, 0, entry.size, in_parts=True)
                done["files"] += 1
            except (OSError, StoreError) as exc:
                failed.append({"path": node.path, "error": _reason(exc)})
            finally:
                del active[node.inode]
                done["bytes"] += node.size
                with trio.CancelScope(shield=True):
                    await self.workers.disk(self.cache.release, entry)

        async def ticker() -> None:
            while True:
                await trio.sleep(PROGRESS_INTERVAL)
                await emit(progress_now())

        todo = iter(files)

        async def worker() -> None:  # `parallel` of them: a bounded number of tasks
            for node in todo:
                await one(node)

        async with trio.open_nursery() as outer:
            outer.start_soon(ticker)
            async with trio.open_nursery() as inner:
                for _ in range(min(parallel, len(files))):
                    inner.start_soon(worker)
            outer.cancel_scope.cancel()
        await emit(progress_now())
        fetched = self._fetched_bytes() - get_before
        seconds = time.monotonic() - started
        log.info("warmup: %d file(s), %d bytes in %.1fs, %d failed",
                 done["files"], total, seconds, len(failed))
        return {
            "files": len(files),
            "warmed_files": done["files"],
            "bytes": total,
            "fetched_bytes": int(fetched),
            "seconds": seconds,
            "failed": failed,
        }

    def _fetched_bytes(self) -> float:
        return self.metrics.store_bytes_of("get")

    # -- cache -----------------------------------------------------------------------

    async def cache_ls(self, req: dict[str, Any]) -> dict[str, Any]:
        prefix = relpath(req.get("prefix", ""))

        def listing() -> list[dict[str, Any]]:
            return [dataclasses.asdict(o) for o in self.cache.iter_objects(prefix)]

        objs = await self.workers.disk(listing)
        objs.sort(key=lambda o: o["key"])
        return {"objects": objs}

    async def cache_evict(self, req: dict[str, Any]) -> dict[str, Any]:
        """Drop one object's cached bytes, or every object under a directory."""
        rel = relpath(req.get("path", ""))

        def evict() -> dict[str, Any]:
            exact = self.cache.lookup(rel) if rel else None
            if exact is not None:
                keys = [rel]
            else:
                prefix = f"{rel}/" if rel else ""
                keys = [o.key for o in self.cache.iter_objects(prefix)]
            evicted, refused = [], []
            for k in keys:
                before = self.cache.lookup(k)
                if self.cache.evict(k):
                    evicted.append({"key": k, "bytes": before.cached_bytes if before else 0})
                else:
                    refused.append(k)
            return {"evicted": evicted, "refused": refused}

        out = await self.workers.disk(evict)
        if not out["evicted"] and not out["refused"]:
            raise ValueError(f"{rel or '/'}: nothing of it is in tier 1")
        log.info("cache evict %s: %d object(s) evicted, %d refused (not uploaded yet)",
                 rel or "/", len(out["evicted"]), len(out["refused"]))
        return out

    async def cache_verify(self, req: dict[str, Any]) -> dict[str, Any]:
        started = time.monotonic()
        report = await self.workers.disk(self.cache.verify_all)
        stats = await self.workers.disk(self.cache.stats)
        bad = [{"key": k, "chunks": chunks} for k, chunks in report]
        if bad:
            log.warning("cache verify: dropped %d bad chunk(s) in %d object(s)",
                        sum(len(b["chunks"]) for b in bad), len(bad))
        return {"objects": stats.objects, "bad": bad, "seconds": time.monotonic() - started}

    async def cache_stats(self, req: dict[str, Any]) -> dict[str, Any]:
        stats = await self.workers.disk(self.cache.stats)
        return {"stats": dataclasses.asdict(stats), "cache_dir": str(Path(self.cache.root))}

    # -- policy ----------------------------------------------------------------------

    async def classify(self, req: dict[str, Any]) -> dict[str, Any]:
        rel = relpath(req.get("path", ""))
        decision = self.policy.classify(rel)
        return _jsonable({
            "path": rel,
            "class": decision.settings.name,
            "rule": decision.rule,
            "settings": dataclasses.asdict(decision.settings),
        })
