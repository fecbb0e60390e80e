"""What FUSE passthrough asks of a tier-1 entry (read/modes.py): whether it is
whole and verified, a reference taken without waiting, and chunks that
eviction must not punch while the kernel reads the file itself."""

from __future__ import annotations

import os
from pathlib import Path

from tierfs.cache import Cache

CS = 4096


def new_cache(root: Path, capacity: int = 1 << 30) -> Cache:
    c = Cache(root, capacity=capacity, chunk_size=CS, min_free=0)
    c.bind("file:///src")
    return c


def test_completeness_partial_complete_verified(tmp_path: Path) -> None:
    data = os.urandom(3 * CS + 100)
    c = new_cache(tmp_path / "c")
    e = c.open("k", "e1", len(data), 0.0)
    assert e.completeness() == "partial"
    e.store(0, data[: 2 * CS])
    assert e.completeness() == "partial"
    e.store(2 * CS, data[2 * CS :])
    assert e.completeness() == "verified"  # fetched here: checked as it was stored
    c.release(e)
    c.close()

    c = new_cache(tmp_path / "c")  # a restart: chunks on disk are not trusted yet
    e = c.open("k", "e1", len(data), 0.0)
    assert e.completeness() == "complete"
    assert e.verify() == []
    assert e.completeness() == "verified"
    e.write(0, b"local")
    assert e.completeness() == "partial"  # written here: the daemon path
    c.release(e)
    c.close()


def test_an_empty_object_is_verified(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    e = c.open("empty", "e", 0, 0.0)
    assert e.completeness() == "verified"
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
    a.store(0, data)
    n = a.chunk_count()
    a.pin_all()
    assert not c.evict("a") or a.present(0, len(data))
    b = c.open("b", "e", len(data), 0.0)
    b.store(0, data)  # over capacity: eviction runs
    assert a.present(0, len(data))
    with open(a.path, "rb") as f:
        assert f.read() == data
    a.unpin_all(n)
    c.evict("a")
    assert not a.present(0, len(data))
    c.release(a)
    c.release(b)
    c.close()


def test_writes_the_kernel_made_are_taken_in_at_seal(tmp_path: Path) -> None:
    """A passthrough writer's bytes never pass `Entry.write`: the seal learns the
    length from the file and checksums what is there, not running sums of
    writes made before the kernel took over."""
    c = new_cache(tmp_path / "c")
    e = c.open("new", "", 0, 0.0)
    e.truncate(0)  # O_CREAT: dirty, empty
    e.write(0, b"a" * CS)  # a running checksum the kernel's writes void
    fd = e.begin_external()
    data = os.urandom(5 * CS + 7)
    os.pwrite(fd, data, 0)  # what the kernel does with the registered file
    assert e.size == CS  # not seen yet
    assert e.adopt_external().st_size == len(data) and e.size == len(data)
    os.pwrite(fd, b"more", len(data))
    e.set_state("sealed")
    assert e.size == len(data) + 4
    assert e.verify() == []  # the recorded checksums are the file's
    assert e.read(0, e.size) == data + b"more"
    os.pwrite(fd, b"after the seal", 0)  # a write after fsync: dirty again, sealed again
    e.set_state("dirty")
    e.end_external()
    e.set_state("sealed")
    assert e.verify() == []
    assert e.read(0, 14) == b"after the seal"
    c.release(e)
    c.close()


def test_only_a_local_write_may_be_written_by_the_kernel(tmp_path: Path) -> None:
    c = new_cache(tmp_path / "c")
    e = c.open("k", "e1", CS, 0.0)
    e.store(0, os.urandom(CS))
    try:
        e.begin_external()
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
    e.store(0, data)
    e.set_state("dirty")
    e.begin_external()
    assert e.undirty("e1")
    assert e.state == "clean" and e.completeness() == "verified"
    e.end_external()
    e.set_state("dirty")
    fd = e.begin_external()
    os.pwrite(fd, b"changed", CS)
    assert not e.undirty("e1") and e.state == "dirty"
    e.end_external()
    e.set_state("sealed")
    assert e.verify() == []
    c.release(e)
    c.close()
