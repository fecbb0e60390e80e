"""The kept-listing record (tierfs/cache/listings.py): what goes in comes out,
and a record that is not this prefix's, or torn, is refused."""

from __future__ import annotations

import pytest

from tierfs.cache.listings import BadListing, decode, encode
from tierfs.store.base import Listing, ObjectInfo


def sample(prefix: str) -> Listing:
    files = [ObjectInfo(f"{prefix}img-{i:05d}.jpg", 100 * 1024 + i, f"{i:032x}", 1.7e9 + i / 3)
             for i in range(1000)]
    files.append(ObjectInfo(prefix + "ñandú \udcff.bin", 0, "", 0.0))  # any name a key can have
    return Listing(files, ["sub", "ünï", "x" * 255])


@pytest.mark.parametrize("prefix", ["", "train/", "a/b/ç/"])
def test_round_trip(prefix: str) -> None:
    listing = sample(prefix)
    got, when = decode(prefix, encode(prefix, listing, 1234.5))
    assert got == listing and when == 1234.5


def test_empty_directory() -> None:
    assert decode("d/", encode("d/", Listing([], []), 1.0)) == (Listing([], []), 1.0)


def test_another_prefix_or_a_torn_record_is_refused() -> None:
    raw = encode("train/", sample("train/"), 1.0)
    with pytest.raises(BadListing):
        decode("val/", raw)
    with pytest.raises(BadListing):
        decode("train/", raw[:-7])
    with pytest.raises(BadListing):
        decode("train/", raw + b"\0")
    with pytest.raises(BadListing):
        decode("train/", b"\x09" + raw[1:])  # another version
