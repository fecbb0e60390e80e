"""The chunk map (tierfs/cache/chunkmap.py) alone: pure bookkeeping of what tier 1
holds of one object, no file, no lock."""

from __future__ import annotations

from tierfs.cache.chunkmap import PAGE, ChunkMap, nchunks
from tierfs.cache.index import ABSENT, STORED, VERIFIED, WRITTEN

CS = 4 * PAGE


def chunk_map(states: str, size: int | None = None) -> ChunkMap:
    """A map from a string: '.' absent, 's' stored, 'v' verified, 'w' written."""
    code = {".": ABSENT, "s": STORED, "v": VERIFIED, "w": WRITTEN}
    return ChunkMap(CS, len(states) * CS if size is None else size,
                    bytearray(code[c] for c in states))


def test_missing_is_the_complement_of_present_as_coalesced_ranges() -> None:
    m = chunk_map("v..sv...", size=8 * CS - 100)
    assert m.missing(0, m.size) == [(CS, 3 * CS), (5 * CS, 8 * CS - 100)]
    assert m.missing(CS + 5, CS + 6) == [(CS, 2 * CS)]  # whole chunks
    assert m.missing(3 * CS, 5 * CS) == []
    assert m.missing(-5, 10 * CS) == m.missing(0, m.size)  # clipped
    assert m.present(3 * CS, 5 * CS) and not m.present(0, 2 * CS)
    assert m.present(9 * CS, 10 * CS)  # nothing past the end is missing


def test_complete_verified_unverified_mean_one_thing_each() -> None:
    assert chunk_map("vvv").complete() and chunk_map("vvv").verified()
    assert chunk_map("vsv").complete() and not chunk_map("vsv").verified()
    assert chunk_map("vsv").unverified() and not chunk_map("vwv").unverified()
    assert not chunk_map("v.v").complete() and not chunk_map("v.v").verified()
    assert chunk_map("vwv").complete() and not chunk_map("vwv").verified()


def test_pages_of_absent_chunks_serve_small_reads() -> None:
    m = chunk_map("v..v")
    assert m.missing_pages(CS + 100, CS + 200) == [(CS, CS + PAGE)]
    m.add_pages(CS, CS + 2 * PAGE)
    assert m.missing_pages(CS + 100, CS + 2 * PAGE) == []
    assert m.missing_pages(CS, 2 * CS + 1) == [(CS + 2 * PAGE, 2 * CS + PAGE)]
    assert m.servable_now(CS, CS + 2 * PAGE) and not m.servable_now(CS, CS + 3 * PAGE)
    assert m.servable_now(0, CS) and not chunk_map("s").servable_now(0, 10)
    m.stored(1, 1)  # the whole chunk came: its pages are superseded
    assert 1 not in m.pages and m.states[1] == VERIFIED and m.last == (1, 1)


def test_pins_count_and_the_kernel_pins_everything() -> None:
    m = chunk_map("vvvv")
    assert m.chunks_of(CS + 1, 3 * CS) == (1, 2)
    m.pin(1, 2)
    m.pin(2, 2)
    m.unpin(1, 2)
    assert not m.pinned(1) and m.pinned(2) and not m.pinned(0)
    m.kernel += 1
    assert m.pinned(0)


def test_resize_cuts_or_adds_written_chunks() -> None:
    m = chunk_map("vv")
    m.resize(5 * CS - 1)
    assert bytes(m.states) == bytes((VERIFIED, VERIFIED, WRITTEN, WRITTEN, WRITTEN))
    assert m.chunk_len(4) == CS - 1 and len(m) == nchunks(m.size, CS) == 5
    m.resize(CS + 1)
    assert len(m) == 2 and m.size == CS + 1
