"""What a file's upload or seal makes other requests wait for (issue 33): the
per-file lock guards state changes only. Seal, upload and publish run with it
let go, so requests that change nothing of that file (a stat, a read, a
release of another handle) and requests on other files (a truncate) neither
wait for the lock nor for the store.

Each test holds one store request (or the seal's fsync) in flight with a gate,
a stand-in for a slow link that orders events without timing (a real slow
store cannot say when the request is in flight), runs the other requests
meanwhile, and counts: the waits for any file's lock while that file uploaded
(Journal.lock_waits), and that every request returned before the gate opened.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any

import trio

from tests.unit.model_kernel import Kernel, config, harness_mount
from tierfs.store.base import Store

MiB = 1 << 20
THROUGH = '[classes.default]\nwrite_mode = "writethrough"\n'
HANG = 60  # seconds: a request that waits for the gate never returns before it opens


class Gate:
    """Holds the calls of a store (or any blocking) method matching `match` until
    opened; they run in worker threads."""

    def __init__(self, match: Callable[..., bool]) -> None:
        self.match = match
        self.entered = threading.Event()
        self.opened = threading.Event()

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(fn)
        def gated(*args: Any, **kwargs: Any) -> Any:
            if self.match(*args, **kwargs):
                self.entered.set()
                self.opened.wait(HANG)
            return fn(*args, **kwargs)

        return gated

    async def in_flight(self) -> None:
        assert await trio.to_thread.run_sync(self.entered.wait, HANG)


def gate_puts(gate: Gate) -> Callable[[Store], None]:
    def hook(store: Store) -> None:
        for name in ("put_bytes", "complete_upload"):
            setattr(store, name, gate.wrap(getattr(store, name)))

    return hook


async def write_file(k: Kernel, path: str, data: bytes) -> None:
    fh = await k.open(path, os.O_WRONLY | os.O_CREAT)
    await k.pwrite(fh, data, 0)
    await k.close(fh)


async def test_a_write_through_close_holds_up_no_other_request(tmp_path: Path) -> None:
    """While a write-through close uploads (its PUT held in flight): fstat and reads
    of the same file through another handle, the release of a third handle of
    it, and a truncate of another file answer, none waiting for a lock."""
    data = os.urandom(4 * MiB)
    gate = Gate(lambda key, *a, **kw: key == "out.txt")
    cfg = config(tmp_path / "store", tmp_path / "cache", tmp_path / "mnt", THROUGH)
    (tmp_path / "store").mkdir()
    async with harness_mount(cfg, gate_puts(gate)) as parts:
        k = Kernel(parts)
        await write_file(k, "other.pt", os.urandom(MiB))  # write-back: truncated below
        writer = await k.open("out.txt", os.O_WRONLY | os.O_CREAT)
        await k.pwrite(writer, data, 0)
        reader = await k.open("out.txt", os.O_RDONLY)
        third = await k.open("out.txt", os.O_WRONLY)
        closed = trio.Event()

        async def close_writer() -> None:
            await k.close(writer)  # write-through: returns once the store has it
            closed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(close_writer)
            await gate.in_flight()
            out = parts.journal.get("out.txt")
            assert out is not None and out.upload is not None
            with trio.move_on_after(HANG) as guard:
                for i in range(20):
                    assert await k.size("out.txt") == len(data)
                    got = await k._call(parts.ops.read, reader, i * 4096, 4096)
                    assert got == data[i * 4096:(i + 1) * 4096]
                    await k.truncate("other.pt", MiB - 4096 * (i % 2))
                await k.close(third)
            assert not guard.cancelled_caught  # a hang: something waited for the upload
            assert not closed.is_set() and not gate.opened.is_set()  # all before it landed
            assert out.lock.waits.total == 0  # nothing waited for the uploading file's lock
            gate.opened.set()
        await k.close(reader)
    assert (tmp_path / "store" / "out.txt").read_bytes() == data


async def test_a_writer_does_not_wait_for_the_upload_it_stops(tmp_path: Path) -> None:
    """A truncate of a write-back file whose upload is in flight stops it and goes
    on at once: it neither waits for the upload's store request nor for a lock.
    The stopped upload commits nothing of the version it read."""
    (tmp_path / "store").mkdir()
    gate = Gate(lambda key, *a, **kw: key == "f.pt")
    cfg = config(tmp_path / "store", tmp_path / "cache", tmp_path / "mnt")
    async with harness_mount(cfg, gate_puts(gate)) as parts:
        k = Kernel(parts)
        await write_file(k, "f.pt", os.urandom(4 * MiB))  # checkpoint: uploads at once
        await gate.in_flight()
        pf = parts.journal.get("f.pt")
        assert pf is not None and pf.upload is not None
        with trio.move_on_after(HANG) as guard:
            await k.truncate("f.pt", 1000)
            assert await k.size("f.pt") == 1000
        assert not guard.cancelled_caught  # a hang: the truncate waited for the upload
        assert not gate.opened.is_set()  # it returned with the upload still in flight
        assert pf.lock.waits.uploading == 0
        gate.opened.set()
        out = await parts.pending.flush("")
        assert out.ok, out.asdict()
        body = await k.read_all("f.pt")
    assert len(body) == 1000
    assert (tmp_path / "store" / "f.pt").read_bytes() == body


async def test_a_seal_holds_the_lock_only_for_its_record(tmp_path: Path) -> None:
    """The bulk of a durable seal (fsync of the file's bytes) runs with the lock let
    go: meanwhile a stat and a read of the file, the release of another handle
    of it and a truncate of another file answer without waiting for a lock."""
    (tmp_path / "store").mkdir()
    data = os.urandom(4 * MiB)
    cfg = config(tmp_path / "store", tmp_path / "cache", tmp_path / "mnt")
    fsyncs = Gate(lambda fd: True)
    async with harness_mount(cfg) as parts:
        k = Kernel(parts)
        await write_file(k, "other.pt", os.urandom(MiB))
        writer = await k.open("big.pt", os.O_WRONLY | os.O_CREAT)
        await k.pwrite(writer, data, 0)
        reader = await k.open("big.pt", os.O_RDONLY)
        second = await k.open("big.pt", os.O_WRONLY)
        tier1 = parts.ops.wb.tier1
        real = tier1.workers.disk

        async def disk(fn: Callable[..., Any], *args: Any) -> Any:
            if fn is os.fsync:  # the seal's fsync of the file's bytes, held in flight
                return await real(fsyncs.wrap(fn), *args)
            return await real(fn, *args)

        tier1.workers = type("W", (), {"disk": staticmethod(disk)})()  # type: ignore[assignment]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(k.fsync, writer)
            await fsyncs.in_flight()
            big = parts.journal.get("big.pt")
            assert big is not None
            with trio.move_on_after(HANG) as guard:
                assert await k.size("big.pt") == len(data)
                assert await k._call(parts.ops.read, reader, 0, 4096) == data[:4096]
                await k.truncate("other.pt", 4096)
                await k.close(second)
            assert not guard.cancelled_caught  # a hang: something waited for the seal
            assert not fsyncs.opened.is_set()
            assert big.lock.waits.total == 0
            fsyncs.opened.set()
        tier1.workers = parts.workers
        await k.close(writer)
        await k.close(reader)
