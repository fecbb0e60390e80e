"""Shared looks at an object's blocks (tierfs/sharedtier/looks.py): one LIST serves
every fill of a node while it is fresh; a failed one is asked again."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from tierfs.sharedtier.looks import Looks
from tierfs.store.base import Listing, ObjectInfo, StoreError

FRESH = 0.2
BLOCKS = "v1/src/obj/etag/16/"


class Folder:
    """A store's list_dir of one folder: takes 0.05 virtual seconds; counts calls."""

    def __init__(self) -> None:
        self.keys = [BLOCKS + "0", BLOCKS + "1.claim"]
        self.lists = 0
        self.fail = False

    async def meta(self, fn: Any, *args: Any) -> Any:
        await trio.sleep(0.05)
        return fn(*args)

    def list_dir(self, prefix: str) -> Listing:
        self.lists += 1
        if self.fail:
            raise StoreError("gateway says no", kind="io")
        return Listing([ObjectInfo(k, 1, f"e-{k}", 0.0) for k in self.keys if k.startswith(prefix)],
                       [])


def looks(folder: Folder) -> Looks:
    return Looks(folder, folder.meta, fresh=FRESH, now=trio.current_time)  # type: ignore[arg-type]


async def test_fills_looking_at_once_share_one_list(mock_clock: trio.testing.MockClock) -> None:
    mock_clock.autojump_threshold = 0
    folder = Folder()
    lk = looks(folder)
    found: dict[str, ObjectInfo | None] = {}

    async def find(key: str) -> None:
        found[key] = await lk.find(key)

    async with trio.open_nursery() as nursery:
        for key in ("0", "1", "1.claim", "2"):
            nursery.start_soon(find, BLOCKS + key)
    assert folder.lists == 1
    assert {k[len(BLOCKS):]: v is not None for k, v in found.items()} == {
        "0": True, "1": False, "1.claim": True, "2": False}


async def test_a_listing_serves_while_fresh_then_is_asked_again(
    mock_clock: trio.testing.MockClock,
) -> None:
    mock_clock.autojump_threshold = 0
    folder = Folder()
    lk = looks(folder)
    assert await lk.find(BLOCKS + "1") is None
    folder.keys.append(BLOCKS + "1")  # put meanwhile
    await trio.sleep(FRESH / 2 - 0.05)  # fresh: counted from when the LIST was asked
    assert await lk.find(BLOCKS + "1") is None
    assert folder.lists == 1
    await trio.sleep(FRESH)
    assert await lk.find(BLOCKS + "1") is not None
    assert folder.lists == 2


async def test_a_failed_list_is_the_askers_error_and_the_next_look_asks_again(
    mock_clock: trio.testing.MockClock,
) -> None:
    mock_clock.autojump_threshold = 0
    folder = Folder()
    folder.fail = True
    lk = looks(folder)
    with pytest.raises(StoreError):
        await lk.find(BLOCKS + "0")
    folder.fail = False
    assert await lk.find(BLOCKS + "0") is not None
    assert folder.lists == 2
