"""Fixtures of the fault tests: the fault proxy, mounts pointed at it, a fast store config."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fault.proxy import FaultProxy, Rule
from tests.integration.conftest import mount_factory  # noqa: F401  (re-exported fixture)
from tests.support.seaweed import SeaweedServer

MiB = 1 << 20


def flaky_rules(rate: float = 0.2, ops: set[str] | None = None) -> list[Rule]:
    """`rate` of matching requests fail, split evenly between 503, reset and truncation.

    Rules are drawn in order (first match wins), so the conditional probabilities
    are raised so that each fault hits rate/3 of all requests.
    """
    each = rate / 3
    out = []
    left = 1.0
    for fault in ("503", "reset", "truncate"):
        out.append(Rule(fault, ops=ops, probability=min(1.0, each / left)))  # type: ignore[arg-type]
        left -= each
    return out


def store_config(tmp_path: Path, *, deadline: float = 5.0, read_timeout: float = 2.0,
                 connect_timeout: float = 1.0, extra: str = "") -> Path:
    """A TOML config with a short store deadline, so that outages are seen fast."""
    path = tmp_path / "fault.toml"
    path.write_text(
        "[store]\n"
        f"deadline = {deadline}\n"
        f"read_timeout = {read_timeout}\n"
        f"connect_timeout = {connect_timeout}\n" + extra
    )
    return path


@pytest.fixture
def proxy(s3_server: SeaweedServer) -> Iterator[FaultProxy]:
    with FaultProxy(upstream=s3_server.endpoint, seed=7) as p:
        yield p
