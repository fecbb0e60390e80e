"""Tier 1's limits against its filesystem (cache/sizing.py): pure arithmetic."""

from __future__ import annotations

import pytest

from tierfs.cache.sizing import SizingError, plan
from tierfs.config import GiB, MiB


def test_defaults_on_a_big_disk_keep_80_percent_of_free_and_a_1gib_floor() -> None:
    s = plan("/c", 2000 * GiB, 1000 * GiB, 0, size=None, min_free=None)
    assert s.capacity == int(1000 * GiB * 0.8) and s.min_free == 1 * GiB and s.warning is None


def test_defaults_on_a_small_disk_scale_the_floor() -> None:
    s = plan("/c", 64 * MiB, 60 * MiB, 0, size=None, min_free=None)
    assert s.min_free == int(64 * MiB * 0.05)
    assert s.capacity == int(60 * MiB * 0.8)


def test_what_tier1_holds_counts_as_room() -> None:
    s = plan("/c", 100 * GiB, 10 * GiB, 40 * GiB, size=None, min_free=None)
    assert s.capacity == int(50 * GiB * 0.8)


def test_a_size_the_disk_cannot_hold_is_cut_with_one_warning() -> None:
    s = plan("/c", 64 * MiB, 60 * MiB, 0, size=1 * GiB, min_free=None)
    assert s.capacity == 60 * MiB - s.min_free
    assert s.warning is not None and "1.0 GiB" in s.warning and "\n" not in s.warning


def test_a_size_that_fits_is_taken_as_is() -> None:
    assert plan("/c", 100 * GiB, 50 * GiB, 0, size=20 * GiB, min_free=None).capacity == 20 * GiB


@pytest.mark.parametrize(
    ("fs", "free", "size", "min_free", "expect"),
    [
        (64 * MiB, 60 * MiB, 1 * MiB, None, "below the minimum"),
        (64 * MiB, 60 * MiB, None, 64 * MiB, "not below the size"),
        (64 * MiB, 60 * MiB, None, 59 * MiB, "minimum tier 1"),
        (64 * MiB, 1 * MiB, None, None, "minimum tier 1"),
    ],
)
def test_unusable_sizes_are_one_clear_error(
    fs: int, free: int, size: int | None, min_free: int | None, expect: str
) -> None:
    with pytest.raises(SizingError) as exc:
        plan("/c", fs, free, 0, size=size, min_free=min_free)
    assert expect in str(exc.value) and "\n" not in str(exc.value)
