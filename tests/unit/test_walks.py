"""Walk detection over listing positions (tierfs/read/walks.py): what each kind
of reader gets fetched ahead, and what a shuffled reader wastes."""

from __future__ import annotations

import random

import pytest

from tierfs.read.walks import Walks

N = 10_000


def run(walks: Walks, order: list[int], count: int = N) -> tuple[list[int], set[int]]:
    """Open positions in `order`; every position fetched ahead (in order asked),
    and those that were never opened afterwards (waste)."""
    fetched: list[int] = []
    opened: set[int] = set()
    for pos in order:
        opened.add(pos)
        fetched.extend(walks.opened("d", pos, count))
    return fetched, set(fetched) - opened


def test_serial_walk_fetches_ahead_each_file_once_within_the_directory() -> None:
    fetched, wasted = run(Walks(4, 64), list(range(N)))
    assert len(fetched) == len(set(fetched))  # never asked twice
    assert set(fetched) == set(range(3, N))  # from the third open on, everything ahead
    assert not wasted


def test_window_doubles_up_to_the_maximum() -> None:
    w = Walks(4, 64)
    got = [len(w.opened("d", pos, N)) for pos in range(12)]
    # opens 0, 1 see nothing; then 4 ahead, then topped up as the window doubles
    assert got[:2] == [0, 0]
    assert got[2] == 4 and got[3] == 1 + 4 and got[4] == 1 + 8
    assert max(len(w.opened("d", pos, N)) for pos in range(12, 400)) <= 64


def test_a_full_window_is_topped_up_in_strides_of_half() -> None:
    """Once the window is at its maximum, the files ahead are asked for half a
    window at a time (one open-ahead hop per 32 files, not one per file)."""
    w = Walks(4, 64)
    got = [len(w.opened("d", pos, N)) for pos in range(400)]
    steady = got[40:]
    assert set(steady) == {0, 32}
    assert steady.count(32) == len(steady) // 32
    ahead = sum(got)  # positions asked for so far: never less than half a window ahead
    assert ahead - 400 >= 32


def test_eight_cursors_each_in_order_all_fetch_ahead() -> None:
    """xargs -P8 -n64: eight readers, each walking its own batch in order."""
    order = []
    for batch in range(0, 512, 64 * 8):
        for k in range(64):
            order += [batch + w * 64 + k for w in range(8)]
    fetched, wasted = run(Walks(4, 64), order, 512)
    assert len(set(fetched)) >= 512 - 8 * 3 - 8 * 64 // 2  # most of each batch
    assert len(wasted) <= 8 * 64  # at most a window past each batch's end


def test_dataloader_workers_slightly_out_of_order_are_one_walk() -> None:
    rng = random.Random(0)
    order = list(range(2000))
    for i in range(0, len(order) - 8, 8):  # 8 workers: each batch of 8 arrives shuffled
        block = order[i : i + 8]
        rng.shuffle(block)
        order[i : i + 8] = block
    fetched, wasted = run(Walks(4, 64), order, 2000)
    assert len(set(fetched)) >= 1900
    assert not wasted


@pytest.mark.parametrize(("count", "sample"), [(10_000, 1000), (400, 100)])
def test_shuffled_reader_wastes_little(count: int, sample: int) -> None:
    """4 workers of a shuffled sampler over a sample of the directory."""
    rng = random.Random(1)
    order = rng.sample(range(count), sample)
    _, wasted = run(Walks(4, 64), order, count)
    assert len(wasted) <= 0.1 * sample


def test_windows_are_per_directory() -> None:
    w = Walks(4, 64)
    for pos in range(3):
        w.opened("a", pos, N)
    assert not w.opened("b", 3, N)  # "b" has no walk yet
    assert w.opened("a", 3, N)
