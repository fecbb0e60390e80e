"""What became of a file written through this mount, told to whoever listens.

The write path decides a file's fate (its bytes landed in the store, were
dropped, or lost a manifest's race) and says so with one typed event; the
namespace, which shows the file, listens. Listeners are subscribed in the
composition root (mount.py) and nowhere else, so data flows one way: the
write path never calls into the namespace, and no object's callback is
patched onto another after construction (DESIGN §8).

Delivery is in order and awaited: `emit` returns once every listener took
the event. The uploader relies on it: the namespace must hold a landed
file's new ETag before the cache record turns clean under it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tierfs.store.base import ObjectInfo


@dataclass(frozen=True)
class Landed:
    """The store holds `key` as `info` (an upload, or a rename's server-side copy)."""

    key: str
    info: ObjectInfo


@dataclass(frozen=True)
class Dropped:
    """`key`'s local bytes are gone without landing (never acknowledged, discarded,
    or quarantined as `reason`): the store's version, if any, shows again."""

    key: str
    reason: str


@dataclass(frozen=True)
class Conflict:
    """A manifest's background publish lost its race: its bytes were kept aside at
    `kept_at`, not published; the store's version shows again."""

    key: str
    kept_at: str


FileEvent = Landed | Dropped | Conflict
Listener = Callable[[FileEvent], Awaitable[None]]


class FileEvents:
    """One notification of what became of written files (trio side only)."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> None:
        """Called by the composition root while it builds the mount."""
        self._listeners.append(listener)

    async def emit(self, event: FileEvent) -> None:
        for listener in self._listeners:
            await listener(event)
