"""One generic single-flight: N waiters of the same bytes cause one fetch.

Every fetch kind of the read path claims what it fetches here, each in a
table of its own (`SingleFlight` instances): tier-1 chunks, pages of small
reads, parts read through memory, whole small objects fetched ahead of a walk.
A fetch claims a run of keys (the chunks of one part, say) with one `Flight`;
anyone needing any of those keys meanwhile waits on that flight instead of
fetching again, and learns its outcome (its error, re-raised). Whatever
happens to the fetch (done, failed, cancelled), its keys are released and its
waiters woken: `fly` is the only way a flight ends.

Like JuiceFS's singleflight (pkg/utils), minus its result sharing: what a
fetch produced lands in tier 1 or in memory (landed parts, bodies), where a
waiter looks after the flight. All of it runs on the trio loop: no locks.
"""

from __future__ import annotations

import errno
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Any, Generic, TypeVar

import trio

from tierfs.store.base import StoreError

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class Flight:
    """One fetch in flight; waiters learn its outcome."""

    __slots__ = ("done", "error", "keys")

    def __init__(self, keys: list[Any]) -> None:
        self.done = trio.Event()
        self.error: BaseException | None = None
        self.keys = keys

    async def wait(self) -> None:
        """Until the fetch ended; its error, if it failed."""
        await self.done.wait()
        if self.error is not None:
            raise self.error


class SingleFlight(Generic[K]):
    """The fetches in flight of one kind, by key (trio loop only)."""

    def __init__(self) -> None:
        self._flying: dict[K, Flight] = {}

    def __len__(self) -> int:
        return len(self._flying)

    def __contains__(self, key: object) -> bool:
        return key in self._flying

    def get(self, key: K) -> Flight | None:
        """The flight fetching `key` now, if any."""
        return self._flying.get(key)

    def claim(self, keys: Iterable[K]) -> Flight:
        """A new flight owning `keys` (none of them in flight: see `get`)."""
        claimed = list(keys)
        flight = Flight(claimed)
        for k in claimed:
            if self._flying.setdefault(k, flight) is not flight:
                raise RuntimeError(f"single-flight key {k!r} claimed twice")
        return flight

    def join(self, key: K, start: Callable[[Flight], None]) -> Flight:
        """The flight of `key`: the one in flight, or a new one that `start` launches
        (in a nursery: the caller's cancellation must not cancel others' fetch)."""
        flight = self._flying.get(key)
        if flight is None:
            flight = self.claim((key,))
            start(flight)
        return flight

    async def fly(self, flight: Flight, fetch: Callable[[], Awaitable[T]]) -> T | None:
        """Run `flight`'s fetch: what it returned (None if it failed: its waiters
        learn why). Its keys are released and its waiters woken whatever happens;
        a cancelled fetch tells them the daemon is stopping."""
        error: BaseException | None = None
        try:
            return await fetch()
        except Exception as exc:
            error = _as_oserror(exc)
            return None
        except BaseException:
            error = OSError(errno.EIO, "fetch cancelled: daemon stopping")
            raise
        finally:
            self.land(flight, error)

    def land(self, flight: Flight, error: BaseException | None = None) -> None:
        """End `flight` (for a fetch that never started: `fly` ends the others)."""
        flight.error = error
        for k in flight.keys:
            if self._flying.get(k) is flight:
                del self._flying[k]
        flight.done.set()


async def wait_all(flights: Iterable[Flight]) -> None:
    """Until every flight ended; the first error met."""
    for flight in flights:
        await flight.wait()


def _as_oserror(exc: BaseException) -> BaseException:
    if isinstance(exc, StoreError):
        return OSError(exc.errno, str(exc))
    return exc
