"""Shared fixtures: one real SeaweedFS S3 server per test session."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest

from tests.support.seaweed import SeaweedServer

_bucket_ids = itertools.count()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    srv = SeaweedServer(data_dir=tmp_path_factory.mktemp("seaweed"), volumes_per_bucket=1).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def s3_env(s3_server: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Point the standard AWS_* chain at the test server for this test."""
    env = s3_server.env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture(autouse=True)
def _made_buckets() -> Iterator[list[tuple[SeaweedServer, str]]]:
    """Buckets made by this test, dropped after it. Autouse, so it is set up before
    and torn down after every mount fixture: mounts unmount (and flush) first."""
    made: list[tuple[SeaweedServer, str]] = []
    yield made
    for srv, name in made:
        if srv.proc is not None and srv.proc.poll() is None:
            try:
                srv.drop_bucket(name)
            except Exception as exc:  # teardown must not mask the test's own result
                print(f"could not drop bucket {name}: {exc}")


@pytest.fixture
def bucket(s3_server: SeaweedServer, _made_buckets: list[tuple[SeaweedServer, str]]) -> str:
    """A fresh, empty bucket for this test, dropped with its contents afterwards."""
    name = f"t{os.getpid()}-{next(_bucket_ids)}"
    s3_server.make_bucket(name)
    _made_buckets.append((s3_server, name))
    return name
