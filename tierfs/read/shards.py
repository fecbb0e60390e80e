"""Which file of a sharded model a loader opens next (prefetch.py fetches it ahead).

A model too big for one file is saved as numbered shards beside each other:
`model-00001-of-00004.safetensors` ... `model-00004-of-00004.safetensors`
(Hugging Face, with `pytorch_model-00001-of-00002.bin` for torch shards),
`consolidated.00.pth`, `consolidated.01.pth` (Meta's original checkpoints).
Loaders read them one after another in that order: transformers sorts the
shard names its `*.index.json` maps tensors to, vLLM sorts the files it finds
by name with numbers compared as numbers, and `tierfs coldstart` does the
same. So the shard after `name` is the sibling named the same but for one
number, which is the next larger one; the total in `-of-00004` must match,
so the shards of two checkpoints in one directory are not mixed. A name
with no number, or the last shard, has no next one.

No I/O: the directory's names come from the namespace's listing of it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

from tierfs.store.base import ObjectInfo

_NUMBER = re.compile(r"(\d+)")


def _split(name: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A name's text between its numbers, and its numbers."""
    parts = _NUMBER.split(name)
    return tuple(parts[0::2]), tuple(int(p) for p in parts[1::2])


def next_shard(name: str, siblings: Iterable[str]) -> str | None:
    """The sibling a loader reading shard `name` opens next, or None."""
    text, numbers = _split(name)
    if not numbers:
        return None
    best: tuple[tuple[int, ...], str] | None = None
    head, tail = text[0], text[-1]
    for other in siblings:
        # (cheap string tests first: a directory may hold thousands of names, and
        # this runs on the trio thread)
        if other == name or not other.startswith(head) or not other.endswith(tail):
            continue
        t, n = _split(other)
        if t != text or len(n) != len(numbers):
            continue
        differ = [i for i, (a, b) in enumerate(zip(n, numbers, strict=True)) if a != b]
        if len(differ) != 1 or n[differ[0]] <= numbers[differ[0]]:
            continue
        if best is None or (n, other) < best:
            best = (n, other)
    return None if best is None else best[1]


def next_file_in(
    children: Callable[[str], Mapping[str, int] | None],
    stored: Callable[[int], ObjectInfo | None],
) -> Callable[[str], ObjectInfo | None]:
    """`key` -> the next shard's store attributes, from the namespace's listing of
    its directory (`children`: a directory's path -> its entries, name ->
    inode; `stored`: an inode -> its store attributes); None where the
    directory is not listed, there is no next shard, or it is not a stored file."""

    def next_file(key: str) -> ObjectInfo | None:
        directory, _, name = key.rpartition("/")
        entries = children(directory)
        following = None if entries is None else next_shard(name, entries)
        inode = None if following is None or entries is None else entries.get(following)
        return None if inode is None else stored(inode)

    return next_file
