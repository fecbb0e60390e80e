"""Eviction policy: segmented LRU over whole objects, chunk shedding inside open ones.

Why SLRU and not LRU: a one-pass read of a dataset larger than the cache must
not flush objects that are used again and again (model weights read at every
restart). An object enters the probation segment on its first use; used again
after that, it moves to the protected segment, which may hold at most
PROTECTED_FRACTION of the capacity (overflow is demoted, least recent first, to
the fresh end of probation). Victims come from probation first, then from
protected, least recent first. That is exactly the key order of the index's
`order` database (segment, rank, key hash), so the policy costs no memory per
object and survives restarts without a rebuild.

Open objects are never whole-object victims. When nothing else is left, chunks
of open objects are shed in `shed_order`: farthest behind the object's most
recent store first, so a file bigger than the whole cache streams through it;
the chunks just stored, never.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace

from tierfs.cache.index import PROBATION, PROTECTED, STORED, VERIFIED, Record, WriteTxn, order_key

PROTECTED_FRACTION = 0.8

_SHEDDABLE = re.compile(b"[" + bytes((STORED, VERIFIED)) + b"]+")


def use(
    wt: WriteTxn, kh: bytes, rec: Record, *, access_ns: int, reused: bool, capacity: int
) -> None:
    """Record one use of a clean object in `wt`: move it to the fresh end of its
    segment (protected if it was used before), then keep protected within bounds."""
    seg = PROTECTED if reused or rec.seg == PROTECTED else PROBATION
    wt.put(kh, rec, replace(rec, access_ns=access_ns, rank_ns=access_ns, seg=seg))
    if seg == PROTECTED:
        _rebalance(wt, int(capacity * PROTECTED_FRACTION), access_ns)


def _rebalance(wt: WriteTxn, limit: int, now_ns: int) -> None:
    while wt.counter(b"protected") > limit:
        cur = wt.txn.cursor(db=wt.ix.order)
        if not cur.set_range(bytes((PROTECTED,))):
            return
        okey = bytes(cur.key())
        kh = okey[9:]
        rec = wt.record(kh)
        if rec is None or order_key(kh, rec) != okey:
            wt.delete_order_key(okey)  # left over from a lost transaction
            continue
        wt.put(kh, rec, replace(rec, seg=PROBATION, rank_ns=now_ns))


def shed_order(states: bytearray, keep_lo: int, keep_hi: int) -> Iterator[int]:
    """Present chunks of an open object in the order they should go: behind the
    kept range farthest first, then ahead of it farthest first; the kept range
    [keep_lo, keep_hi] (the most recent store) is never offered."""
    if keep_lo > 0:
        for m in _SHEDDABLE.finditer(states, 0, keep_lo):
            yield from range(m.start(), m.end())
    ahead = [m.span() for m in _SHEDDABLE.finditer(states, keep_hi + 1)]
    for a, b in reversed(ahead):
        yield from range(b - 1, a - 1, -1)
