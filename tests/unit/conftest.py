"""Fixtures shared by the read-path unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tierfs.cache import Cache

SMALL_CHUNK = 64 << 10  # small chunks: a few KiB of test data span many of them


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[Cache]:
    """A tier-1 cache bound to a fake source, 64 KiB chunks (modules defining their
    own `cache` fixture override this one)."""
    c = Cache(tmp_path / "c", capacity=1 << 30, chunk_size=SMALL_CHUNK, min_free=0)
    c.bind("file:///src")
    yield c
    c.close()
