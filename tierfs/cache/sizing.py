"""How much of its filesystem tier 1 may take, decided once at mount (DESIGN §4).

Why at mount and against the real filesystem: a cache size or free-space
floor the disk cannot honour turns every fetch into an eviction (a 64 MiB
cache disk with the old fixed defaults, 256 MiB and 1 GiB, fetched over
200 GiB from the store to read one 200 MiB file). What tier 1 already holds
counts as room it may keep.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierfs.config import (
    CACHE_SHARE_OF_FREE,
    MIN_CACHE_SIZE,
    MIN_FREE_DEFAULT,
    MIN_FREE_SHARE,
    human_size,
)


class SizingError(Exception):
    """The cache filesystem cannot hold a usable tier 1; the message is one line."""


@dataclass(frozen=True)
class Sizes:
    capacity: int  # bytes tier 1 may hold
    min_free: int  # bytes left free on the cache filesystem
    warning: str | None = None  # one line, when a requested size was cut down


def plan(
    where: str, fs_bytes: int, free_bytes: int, held: int, *, size: int | None, min_free: int | None
) -> Sizes:
    """Tier 1's limits on a filesystem of `fs_bytes` with `free_bytes` free, of
    which tier 1 already holds `held` more. `size`/`min_free` None: the defaults
    (CACHE_SHARE_OF_FREE of the free space; a floor of MIN_FREE_SHARE of the
    filesystem, at most MIN_FREE_DEFAULT)."""
    if size is not None and size < MIN_CACHE_SIZE:
        raise SizingError(
            f"cache size {human_size(size)} is below the minimum of {human_size(MIN_CACHE_SIZE)}"
        )
    if min_free is not None and min_free >= fs_bytes:
        raise SizingError(
            f"min_free {human_size(min_free)} is not below the size of the cache "
            f"filesystem of {where} ({human_size(fs_bytes)})"
        )
    floor = min(MIN_FREE_DEFAULT, int(fs_bytes * MIN_FREE_SHARE)) if min_free is None else min_free
    available = free_bytes + held
    room = available - floor
    warning = None
    if size is None:
        capacity = min(int(available * CACHE_SHARE_OF_FREE), room)
    elif size > room:
        capacity = room
        warning = (
            f"cache size {human_size(size)} is more than the cache filesystem of {where} can "
            f"hold ({human_size(free_bytes)} free, {human_size(held)} cached, keeping "
            f"{human_size(floor)} free): using {human_size(max(capacity, 0))}"
        )
    else:
        capacity = size
    if capacity < MIN_CACHE_SIZE:
        raise SizingError(
            f"the cache filesystem of {where} has {human_size(free_bytes)} free; keeping "
            f"min_free {human_size(floor)}, that leaves less than the minimum tier 1 of "
            f"{human_size(MIN_CACHE_SIZE)}: free some space, lower min_free, or pick "
            "another --cache-dir"
        )
    return Sizes(capacity, floor, warning)
