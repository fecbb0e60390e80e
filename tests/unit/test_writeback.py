"""The write path's parts below the kernel: a pending file's state machine, the
journal, the flush barrier, write sessions, the uploader and the publisher,
each driven directly or through a mount built in-process on a file:// store
(model_kernel.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from tests.unit.model_kernel import Kernel, config, harness_mount
from tests.unit.test_lock_waits import Gate, gate_puts, write_file
from tierfs.store.base import StoreError
from tierfs.writeback.barrier import Barrier
from tierfs.writeback.journal import Journal
from tierfs.writeback.pending import LANDED, REFUSED, BadTransition, FileState
from tierfs.writeback.publish import Publisher
from tierfs.writeback.quarantine import Note
from tierfs.writeback.session import WriteSession
from tierfs.writeback.uploader import Uploader

MiB = 1 << 20


# -- pending.py and journal.py ------------------------------------------------------------


def test_a_pending_file_moves_only_along_its_transitions() -> None:
    journal = Journal()
    pf = journal.track("a", 0, 0.0)
    assert pf.state is FileState.STORED and pf.state.record == "clean" and not pf.local
    pf.mark_written()
    assert pf.state is FileState.WRITTEN and pf.state.record == "dirty" and pf.local
    with pytest.raises(BadTransition):
        pf.mark_resumed(1)  # only a record found at start-up is resumed
    pf.mark_sealed(10)
    assert (pf.state, pf.size, pf.version) == (FileState.SEALED, 10, 1)
    pf.mark_written()  # written again: the sealed version is superseded
    assert pf.version == 2
    pf.mark_sealed(12)
    assert not journal.landed(pf, 1)  # an upload of the old version lands nothing
    assert pf.state is FileState.SEALED and journal.get("a") is pf
    assert journal.landed(pf, 2)
    assert pf.state is FileState.GONE and pf.outcome == LANDED and journal.get("a") is None


def test_a_version_written_after_one_landed_is_a_new_one() -> None:
    """A writer holds the file while its last version lands, then writes and closes
    again: the new version has its own number, so a flush waiting for it does
    not take the landing before for its own (the model harness found this)."""
    journal = Journal()
    pf = journal.track("a", 0, 0.0)
    pf.opened(_Closed())
    pf.mark_written()
    pf.mark_sealed(1)
    landed = pf.version
    assert journal.landed(pf, landed) and pf.state is FileState.STORED  # a writer holds it
    pf.mark_written()
    pf.mark_sealed(2)
    assert pf.version > pf.landed_version == landed


class _Closed:
    closed = True

    def observe(self) -> None:
        pass


def test_a_failed_close_leaves_a_file_that_never_lands() -> None:
    journal = Journal()
    pf = journal.track("a", 0, 0.0)
    pf.mark_written()
    pf.mark_sealed(1)
    pf.mark_unsaved()
    assert pf.sealed and pf.local
    assert not journal.landed(pf, pf.version)  # an UNSAVED version never lands
    pf.mark_written()  # written and closed again: it may
    pf.mark_sealed(2)
    assert journal.landed(pf, pf.version)


def test_the_journal_follows_a_rename_and_shows_local_files() -> None:
    journal = Journal()
    pf = journal.track("d/a", 0, 0.0)
    pf.set_fresh(True)
    pf.mark_written()
    journal.rekey(pf, "d/e/b")
    assert journal.get("d/a") is None and journal.get("d/e/b") is pf and not pf.fresh
    files, dirs = journal.local_children("d/")
    assert files == {} and dirs == {"e"}
    assert journal.local_file("d/e/b") is pf
    journal.leave(pf, REFUSED)
    assert journal.local_file("d/e/b") is None and pf.gone.is_set()


# -- barrier.py ------------------------------------------------------------------------------


async def test_the_barrier_waits_for_closed_files_and_reports_the_refused(
        autojump_clock: trio.abc.Clock) -> None:
    journal = Journal()
    hurried = []

    async def notes() -> list[Note]:
        return []

    barrier = Barrier(journal, notes, hurry=hurried.append, release_grace=3.0)
    landing, refused = journal.track("p/a", 0, 0.0), journal.track("p/b", 0, 0.0)
    for pf in (landing, refused):
        pf.mark_written()
        pf.mark_sealed(1)

    async def uploads() -> None:
        await trio.sleep(5)
        journal.landed(landing, landing.version)
        await trio.sleep(5)
        journal.leave(refused, REFUSED)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(uploads)
        out = await barrier.flush("p/")
    assert out.landed == ["p/a"] and [f["key"] for f in out.failed] == ["p/b"]
    assert not out.ok and set(hurried) >= {landing, refused}  # no quiet delay waited for


async def test_the_barrier_gives_up_once_nothing_moves(autojump_clock: trio.abc.Clock) -> None:
    journal = Journal()

    async def notes() -> list[Note]:
        return []

    pf = journal.track("a", 0, 0.0)
    pf.mark_written()
    pf.mark_sealed(1)
    out = await Barrier(journal, notes, hurry=lambda pf: None, release_grace=3.0).flush(
        "", stall=30.0)
    assert out.gave_up and [w["key"] for w in out.waiting] == ["a"]


# -- session.py, uploader.py, publish.py, through a mount's parts -------------------------------


async def test_a_handle_whose_writes_another_close_landed_seals_nothing(tmp_path: Path) -> None:
    """Two handles write one write-through file; the first close uploads the whole
    file (both handles' bytes); the second close has nothing left to send."""
    (tmp_path / "store").mkdir()
    cfg = config(tmp_path / "store", tmp_path / "cache", tmp_path / "mnt",
                 '[classes.default]\nwrite_mode = "writethrough"\n')
    async with harness_mount(cfg) as parts:
        k = Kernel(parts)
        a = await k.open("f.txt", os.O_RDWR | os.O_CREAT)
        b = await k.open("f.txt", os.O_RDWR)
        await k.pwrite(a, b"a" * 10, 0)
        await k.pwrite(b, b"b" * 5, 10)
        session = parts.ops._handles[b]
        assert isinstance(session, WriteSession) and session.dirty
        puts = parts.journal.lock_waits.total
        await k.close(a)
        pf = parts.journal.get("f.txt")
        assert pf is not None and pf.state is FileState.STORED  # landed; b still holds it
        await k.close(b)
        assert not session.dirty and parts.journal.lock_waits.total == puts
    assert (tmp_path / "store" / "f.txt").read_bytes() == b"a" * 10 + b"b" * 5


async def test_a_refused_upload_is_quarantined_not_retried(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    calls = []

    def hook(store: object) -> None:
        def refuse(key: str, *args: object, **kwargs: object) -> object:
            calls.append(key)
            raise StoreError(f"put {key!r}: access denied", kind="access_denied")

        store.put_bytes = refuse  # type: ignore[attr-defined]

    cfg = config(tmp_path / "store", tmp_path / "cache", tmp_path / "mnt")
    async with harness_mount(cfg, hook) as parts:
        assert isinstance(parts.uploader, Uploader)
        k = Kernel(parts)
        await write_file(k, "x.pt", b"data")
        out = await parts.pending.flush("")
        assert [f["key"] for f in out.failed] == ["x.pt"]
        notes = await parts.pending.notes()
        assert [(n.key, n.kind) for n in notes] == [("x.pt", "refused")]
    assert calls == ["x.pt"]  # a permanent refusal: one attempt


async def test_a_manifest_is_published_after_its_barrier_landed(tmp_path: Path) -> None:
    """`step/.metadata` (a manifest, published in the background) goes up only once
    `step/a.pt`, pending in its directory when it closed, is in the store."""
    (tmp_path / "store").mkdir()
    gate = Gate(lambda key, *a, **kw: key == "step/a.pt")
    cfg = config(tmp_path / "store", tmp_path / "cache", tmp_path / "mnt")
    async with harness_mount(cfg, gate_puts(gate)) as parts:
        k = Kernel(parts)
        fh = await k.open("step/a.pt", os.O_WRONLY | os.O_CREAT, mkdirs=True)
        await k.pwrite(fh, b"shard", 0)
        await k.close(fh)
        await gate.in_flight()
        await write_file(k, "step/.metadata", b"index")
        manifest = parts.journal.get("step/.metadata")
        assert manifest is not None and manifest.barrier is not None
        assert isinstance(parts.ops.tree.renames.life.publisher, Publisher)
        assert not (tmp_path / "store" / "step" / ".metadata").exists()
        gate.opened.set()
        out = await parts.pending.flush("")
        assert out.ok, out.asdict()
    assert (tmp_path / "store" / "step" / ".metadata").read_bytes() == b"index"
    assert (tmp_path / "store" / "step" / "a.pt").read_bytes() == b"shard"
