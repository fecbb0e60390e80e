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
    srv = SeaweedServer(data_dir=tmp_path_factory.mktemp("seaweed")).start()
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


@pytest.fixture
def bucket(s3_server: SeaweedServer) -> str:
    """A fresh, empty bucket for this test."""
    name = f"t{os.getpid()}-{next(_bucket_ids)}"
    return s3_server.make_bucket(name)
