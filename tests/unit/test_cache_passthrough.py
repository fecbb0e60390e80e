"""What FUSE passthrough asks of a tier-1 entry (fuse/modes.py): whether it is
whole and verified, a reference taken without waiting, and chunks that
eviction must not punch while the kernel reads the file itself."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from tierfs.cache import Cache, Entry
from tierfs.cache import local as local_module
from tierfs.cache.fileio import file_digests
from tierfs.cache.local import HASH_LATER

CS = 4096


def new_cache(root: Path, capacity: int = 1 << 30) -> Cache:
    c = Cache(root, capacity=capacity, chunk_size=CS, min_free=0)
    c.bind("file:///src")
    return c


def test_completeness_partial_complete_verified(tmp_path: Path) -> None:
    data = os.urandom(3 * CS + 100)
    c = new_cache(tmp_path / "c")
    e = c.open("k", "e1", len(data), 0.0)
    assert e.serve.completeness() == "partial"
    e.serve.store(0, data[: 2 * CS])
    assert e.serve.completeness() == "partial"
    e.serve.store(2 * CS, data[2 * CS :])
    assert e.serve.completeness() == "verified"  # fetched here: checked as it was stored
    c.release(e)
    c.close()

    c = new_cache(tmp_path / "c")  # a restart: chunks on disk are not trusted yet
    e = c.open("k", "e1", len(data), 0.0)
    assert e.serve.completeness() == "complete"
    assert e.serve.verify() == []
    assert e.serve.completeness() == "verified"
    e.local.write(0, b"local")
    assert e.serve.completeness() == "partial"  # written here: the daemon path
    c.release(e)
    c.close()


def test_an_empty_object_is_verified(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    e = c.open("empty", "e", 0, 0.0)
    assert e.serve.completeness() == "verified"
    c.release(e)
    c.close()


def test_retain_takes_a_reference_of_the_open_entry_only(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    e = c.open("k", "e1", CS, 0.0)
    assert c.retain(e)
    c.release(e)
    assert not e.closed  # the retained reference keeps it open
    newer = c.open("k", "e2", CS, 0.0)  # a new version detaches the old entry
    assert not c.retain(e)
    c.release(e)
    assert e.closed
    c.release(newer)
    c.close()


def test_pinned_chunks_survive_eviction(tmp_path: Path) -> None:
    """Over capacity, chunks of open entries are shed; a pinned entry keeps all of
    its bytes on disk (the kernel would read holes as zeros, unchecked)."""
    data = os.urandom(8 * CS)
    c = new_cache(tmp_path / "c", capacity=10 * CS)
    a = c.open("a", "e", len(data), 0.0)
    a.serve.store(0, data)
    a.serve.pin_all()
    assert not c.evict("a") or a.serve.present(0, len(data))
    b = c.open("b", "e", len(data), 0.0)
    b.serve.store(0, data)  # over capacity
    c.evictor.make_room()  # the eviction pass the Evictor runs beside fills
    assert a.serve.present(0, len(data))
    with open(a.path, "rb") as f:
        assert f.read() == data
    a.serve.unpin_all()
    c.evict("a")
    assert not a.serve.present(0, len(data))
    c.release(a)
    c.release(b)
    c.close()


def test_writes_the_kernel_made_are_taken_in_at_seal(tmp_path: Path) -> None:
    """A passthrough writer's bytes never pass `Entry.write`: the seal learns the
    length from the file and checksums what is there, not running sums of
    writes made before the kernel took over."""
    c = new_cache(tmp_path / "c")
    e = c.open("new", "", 0, 0.0)
    e.local.truncate(0)  # O_CREAT: dirty, empty
    e.local.write(0, b"a" * CS)  # a running checksum the kernel's writes void
    fd = e.local.begin_external()
    data = os.urandom(5 * CS + 7)
    os.pwrite(fd, data, 0)  # what the kernel does with the registered file
    assert e.size == CS  # not seen yet
    assert e.local.adopt_external().st_size == len(data) and e.size == len(data)
    os.pwrite(fd, b"more", len(data))
    e.local.seal()
    assert e.size == len(data) + 4
    assert e.serve.verify() == []  # the recorded checksums are the file's
    assert e.serve.read(0, e.size) == data + b"more"
    os.pwrite(fd, b"after the seal", 0)  # a write after fsync: dirty again, sealed again
    e.local.make_dirty()
    e.local.end_external()
    e.local.seal()
    assert e.serve.verify() == []
    assert e.serve.read(0, 14) == b"after the seal"
    c.release(e)
    c.close()


def test_only_a_local_write_may_be_written_by_the_kernel(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    e = c.open("k", "e1", CS, 0.0)
    e.serve.store(0, os.urandom(CS))
    try:
        e.local.begin_external()
    except ValueError:
        pass
    else:
        raise AssertionError("a clean object must not be written by the kernel")
    c.release(e)
    c.close()


def test_an_unwritten_clean_object_goes_back_to_clean(tmp_path: Path) -> None:
    """A clean, verified object made dirty at a writable open (so the kernel may
    write it) and left unwritten is clean again under its ETag, no seal; one
    the kernel wrote is not."""
    data = os.urandom(3 * CS + 9)
    c = new_cache(tmp_path / "c")
    e = c.open("k", "e1", len(data), 0.0)
    e.serve.store(0, data)
    e.local.make_dirty()
    e.local.begin_external()
    assert e.local.undirty("e1")
    assert e.state == "clean" and e.serve.completeness() == "verified"
    e.local.end_external()
    e.local.make_dirty()
    fd = e.local.begin_external()
    os.pwrite(fd, b"changed", CS)
    assert not e.local.undirty("e1") and e.state == "dirty"
    e.local.end_external()
    e.local.seal()
    assert e.serve.verify() == []
    c.release(e)
    c.close()


def _written_by_the_kernel(c: Cache, key: str, data: bytes) -> Entry:
    """A new file whose bytes the kernel wrote (passthrough), not yet sealed."""
    e = c.open(key, "", 0, 0.0)
    e.local.truncate(0)
    fd = e.local.begin_external()
    os.pwrite(fd, data, 0)
    e.local.end_external()
    return e


def test_a_seal_of_bytes_the_kernel_wrote_takes_their_checksums_later(tmp_path: Path) -> None:
    """Reading back a large file the kernel wrote to checksum it was most of a
    safetensors save's close: the seal records the file with a marker and the
    checksums follow (`take_digests`, or whoever needs them: the upload)."""
    data = os.urandom(HASH_LATER + 5 * CS + 3)
    c = new_cache(tmp_path / "c")
    e = _written_by_the_kernel(c, "big", data)
    e.local.seal(durable=False)
    assert e.local.unhashed and c.index.unhashed(e._fid) == (c.boot_id, False)
    assert e.serve.read(0, len(data)) == data  # served meanwhile
    assert not e.local.take_digests(limit=7) and e.local.unhashed
    expected = b"".join(xxhash.xxh3_64_digest(data[o : o + CS]) for o in range(0, len(data), CS))
    assert e.local.chunk_sums() == expected  # the upload takes the rest
    assert not e.local.unhashed and c.index.unhashed(e._fid) is None
    assert e.serve.verify() == []
    c.release(e)
    c.close()
    c = new_cache(tmp_path / "c")
    assert c.finish_seal("big")
    e = c.open_existing("big")
    assert e is not None and e.serve.verify() == [] and not e.local.unhashed
    assert e.local.chunk_sums() == expected
    c.release(e)
    c.close()


def test_checksums_left_to_take_are_hashed_with_the_file_held_from_shrinking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`take_digests` hashes a mapping of the file; a truncate under a mapping is
    SIGBUS (a dead daemon), so every step holds `_io`, which every shrink holds.
    The race itself cannot be produced on demand: the hash is wrapped to look at
    the lock while it reads, and a truncate after the steps finds nothing to take."""
    data = os.urandom(HASH_LATER + 5 * CS + 3)
    c = new_cache(tmp_path / "c")
    e = _written_by_the_kernel(c, "big", data)
    e.local.seal(durable=False)
    steps: list[bool] = []

    def watched(fd: int, start: int, end: int, chunk_size: int) -> Iterator[bytes]:
        for d in file_digests(fd, start, end, chunk_size):
            steps.append(e._io.locked())
            yield d

    monkeypatch.setattr(local_module, "file_digests", watched)
    assert not e.local.take_digests(limit=7)
    assert steps == [True] * 7
    e.local.truncate(3 * CS)  # dirty again: the seal's checksums left to take are void
    assert not e.local.unhashed and e.local.take_digests() and len(steps) == 7
    c.release(e)
    c.close()


def test_a_small_seal_takes_its_checksums_at_once(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    e = _written_by_the_kernel(c, "small", os.urandom(HASH_LATER))
    e.local.seal(durable=False)
    assert not e.local.unhashed and c.index.unhashed(e._fid) is None
    c.release(e)
    c.close()


def test_after_a_restart_unhashed_seals_are_trusted_only_within_the_same_boot_or_fsynced(
    tmp_path: Path,
) -> None:
    """A daemon crash before the checksums were taken: in the same boot the page
    cache kept every byte, so the next start takes them; after a machine restart a
    file closed without fsync may be torn, and nothing could tell: not trusted.
    Another boot cannot be produced in a test: the cache is given another boot id."""
    data = {k: os.urandom(HASH_LATER + CS) for k in ("closed", "fsynced", "fsynced-later")}
    c = new_cache(tmp_path / "c")
    for key, body in data.items():
        e = _written_by_the_kernel(c, key, body)
        e.local.seal(durable=key == "fsynced")
        if key == "fsynced-later":
            e.local.sync()  # fsync(2) after close(2)
        assert e.local.unhashed
        c.release(e)  # the daemon dies before its checksums were taken
    c.close()
    later = Cache(tmp_path / "c", capacity=1 << 30, chunk_size=CS, min_free=0,
                  boot_id=os.urandom(16))
    later.bind("file:///src")
    assert not later.finish_seal("closed")
    assert later.finish_seal("fsynced") and later.finish_seal("fsynced-later")
    for key in ("fsynced", "fsynced-later"):
        e = later.open_existing(key)
        assert e is not None and not e.local.unhashed and e.serve.read(0, e.size) == data[key]
        later.release(e)
    later.close()
    same = new_cache(tmp_path / "c")  # this boot: trusted
    assert same.finish_seal("closed")
    e = same.open_existing("closed")
    assert e is not None and e.serve.verify() == [] and e.serve.read(0, e.size) == data["closed"]
    same.release(e)
    same.close()


def test_a_write_after_an_unhashed_seal_voids_its_pending_checksums(tmp_path: Path) -> None:
    data = bytearray(os.urandom(HASH_LATER + CS))
    c = new_cache(tmp_path / "c")
    e = _written_by_the_kernel(c, "k", bytes(data))
    e.local.seal(durable=False)
    e.local.write(0, b"new bytes")  # dirty again: nothing is left to take of that seal
    assert not e.local.unhashed and e.local.take_digests()
    data[:9] = b"new bytes"
    e.local.seal(durable=False)
    expected = b"".join(xxhash.xxh3_64_digest(data[o : o + CS]) for o in range(0, len(data), CS))
    assert e.local.unhashed and e.local.chunk_sums() == expected
    assert c.index.unhashed(e._fid) is None
    c.release(e)
    c.close()


def test_a_lent_range_is_checked_bytes_kept_whole_until_done(tmp_path: Path) -> None:
    """Serving.lend (a read reply libfuse splices from the file): only chunks this
    process checked, of a clean entry; until `done` eviction punches none of
    them and the fd stays open though the entry lets its own go."""
    data = os.urandom(4 * CS)
    c = new_cache(tmp_path / "c", capacity=6 * CS)
    e = c.open("a", "e", len(data), 0.0)
    assert e.serve.lend(0, CS) is None  # missing
    e.serve.store(0, data)
    assert e.serve.read(0, len(data)) == data  # the page cache holds the file
    lent = e.serve.lend(CS, 2 * CS)
    assert lent is not None
    fd, done = lent
    c.evict("a")
    assert e.serve.present(CS, 3 * CS)  # pinned by the loan
    c.release(e)  # the entry's last reference: its own fd is closed
    assert os.pread(fd, 2 * CS, CS) == data[CS : 3 * CS]
    done()
    try:
        os.fstat(fd)
    except OSError:
        pass
    else:
        raise AssertionError("done() must close the lent fd")
    c.close()


def test_only_chunks_checked_by_this_process_are_lent(tmp_path: Path) -> None:
    data = os.urandom(4 * CS)
    c = new_cache(tmp_path / "c")
    e = c.open("a", "e", len(data), 0.0)
    e.serve.store(0, data)
    c.release(e)
    c.close()
    c = new_cache(tmp_path / "c")  # a restart: chunks on disk are not trusted yet
    e = c.open("a", "e", len(data), 0.0)
    assert e.serve.present(0, len(data))
    assert e.serve.lend(0, CS) is None
    assert e.serve.read(0, CS) == data[:CS]  # its first read checks it
    lent = e.serve.lend(0, CS)
    assert lent is not None and e.serve.lend(0, 2 * CS) is None
    lent[1]()
    fd = os.open(e.path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache
    os.close(fd)
    assert e.serve.lend(0, CS) is None  # a splice would wait for the device
    assert e.serve.read(0, CS) == data[:CS]
    e.local.write(0, b"local")
    assert e.serve.lend(0, CS) is None  # dirty: its bytes are the writer's
    c.release(e)
    c.close()
