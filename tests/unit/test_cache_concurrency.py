"""Tier-1 cache under worker threads, as the daemon drives it through trio.to_thread."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierfs.cache import Cache, ChunkCorrupt
from tierfs.cache.directio import ALIGN, aligned_buffer

CS = 4096


def new_cache(root: Path, capacity: int) -> Cache:
    c = Cache(root, capacity=capacity, chunk_size=CS, min_free=0)
    c.bind("file:///src")
    return c


def run_threads(n: int, fn: Callable[[int], None]) -> None:
    start = threading.Barrier(n)

    def body(t: int) -> None:
        start.wait()
        fn(t)

    with ThreadPoolExecutor(n) as pool:
        for f in [pool.submit(body, t) for t in range(n)]:
            f.result()


def content(key: str, size: int) -> bytes:
    return random.Random(key).randbytes(size)


def test_threads_share_one_entry(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c", capacity=1 << 30)
    size = 64 * CS + 77
    data = content("one", size)
    e = c.open("one", "e", size, 0.0)

    def worker(t: int) -> None:
        rng = random.Random(t)
        mine = [i for i in range(65) if i % 8 == t]
        for _ in range(3):
            for i in mine:
                a, b = i * CS, min((i + 1) * CS, size)
                e.serve.store(a, data[a:b])
                assert e.serve.read(a, b - a) == data[a:b]
                buf = aligned_buffer(b - a + 2 * ALIGN)
                assert bytes(e.serve.read_aligned(a, b - a, buf)) == data[a:b]
                j = rng.randrange(65)
                if e.serve.present(j * CS, (j + 1) * CS):
                    assert e.serve.read(j * CS, CS) == data[j * CS : (j + 1) * CS]

    run_threads(8, worker)
    assert e.serve.read(0, size) == data
    assert c.stats().used_bytes == size
    c.release(e)
    c.close()
    c = new_cache(tmp_path / "c", capacity=1 << 30)
    assert c.verify_all() == []
    c.close()


def test_threads_with_eviction_pressure(tmp_path: Path) -> None:
    """Opens, stores, reads, releases and evictions of overlapping keys from 8
    threads, with a cache a fraction of the working set: reads may miss (the
    reader refetches) but never return wrong bytes, and the bound holds."""
    cap = 24 * CS
    c = new_cache(tmp_path / "c", capacity=cap)
    keys = [f"obj{i}" for i in range(12)]
    sizes = {k: (3 + i % 5) * CS + i for i, k in enumerate(keys)}

    def worker(t: int) -> None:
        rng = random.Random(100 + t)
        for _ in range(150):
            key = rng.choice(keys)
            size = sizes[key]
            data = content(key, size)
            if rng.random() < 0.05:
                c.evict(key)
                continue
            e = c.open(key, "e", size, 0.0)
            try:
                for _ in range(3):
                    i = rng.randrange(-(-size // CS))
                    a, b = i * CS, min((i + 1) * CS, size)
                    if e.serve.missing(a, b):
                        e.serve.store(a, data[a:b])
                    try:
                        assert e.serve.read(a, b - a) == data[a:b]
                    except KeyError:
                        pass  # shed by another thread's store: a reader refetches
                    except ChunkCorrupt as exc:
                        raise AssertionError(f"corruption under concurrency: {exc}") from exc
            finally:
                c.release(e)

    done = threading.Event()

    def evictor() -> None:  # as the mount runs it: beside the stores
        while True:
            c.evictor.wait_wanted()
            if done.is_set():
                return
            c.evictor.make_room()

    beside = threading.Thread(target=evictor)
    beside.start()
    run_threads(8, worker)
    done.set()
    c.evictor.stop()
    beside.join()
    c.evictor.make_room()  # the pass the last stores asked for
    st = c.stats()
    assert st.open_objects == 0 and st.used_bytes <= cap and st.evictions_total > 0
    assert sum(o.cached_bytes for o in c.iter_objects()) == st.used_bytes
    c.close()
    c = new_cache(tmp_path / "c", capacity=cap)
    assert c.verify_all() == []
    assert sum(o.cached_bytes for o in c.iter_objects()) == c.stats().used_bytes
    c.close()
