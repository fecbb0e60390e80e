"""Fixtures for tests against a real FUSE mount of a real SeaweedFS bucket."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.mount import TierfsMount
from tests.support.seaweed import SeaweedServer

MountFactory = Callable[..., TierfsMount]


@pytest.fixture
def mount_factory(
    s3_server: SeaweedServer, tmp_path: Path
) -> Iterator[MountFactory]:
    """Make tierfs mounts; every one is unmounted in teardown, even on failure."""
    made: list[TierfsMount] = []
    counter = iter(range(1000))

    def make(source: str, *extra: str, cache_dir: Path | None = None,
             mountpoint: Path | None = None, start: bool = True,
             env: dict[str, str] | None = None) -> TierfsMount:
        n = next(counter)
        m = TierfsMount(
            source=source,
            mountpoint=mountpoint or tmp_path / f"mnt{n}",
            cache_dir=cache_dir or tmp_path / f"cache{n}",
            env={**os.environ, **(env or s3_server.env())},
            extra=list(extra),
        )
        made.append(m)
        return m.start() if start else m

    yield make
    for m in made:
        m.cleanup()


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[SeaweedServer]:
    """A private SeaweedFS for a test that stops the store mid-test."""
    srv = SeaweedServer(data_dir=tmp_path / "seaweed").start()
    try:
        yield srv
    finally:
        srv.stop()
