"""The flush barrier (DESIGN §5): `tierfs flush`, umount, and a manifest's publish.

When it succeeds, every file under its prefix that was closed before it
started is in the store. "Closed" includes a close(2) that returned while
its RELEASE is still on the way (the kernel sends RELEASE after close(2)
returns; FLUSH, which seals the file, is synchronous): such a file gets a
short grace for its RELEASE, then counts as still open. A file the store
refused for good (or a manifest whose background publish lost its race)
fails the barrier, now and until it is retried or discarded. A barrier waits
for no quiet delay or grace period: it starts the uploads it waits for. It never waits silently or forever: it reports progress as it
goes and gives up once nothing moved for `stall` seconds.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from tierfs.writeback.journal import Journal, PendingFile
from tierfs.writeback.quarantine import FAILED_KINDS, Note

PROGRESS_EVERY = 1.0  # seconds between progress reports
POLL = 0.25  # seconds between looks at the files waited for, at most


@dataclass
class FlushOutcome:
    landed: list[str] = field(default_factory=list)
    failed: list[dict[str, str]] = field(default_factory=list)  # key, reason
    still_open: list[str] = field(default_factory=list)  # not closed: not waited for
    waiting: list[dict[str, object]] = field(default_factory=list)  # when it gave up
    gave_up: bool = False

    @property
    def ok(self) -> bool:
        return not self.failed and not self.gave_up

    def asdict(self) -> dict[str, object]:
        return {"ok": self.ok, "landed": self.landed, "failed": self.failed,
                "still_open": self.still_open, "waiting": self.waiting,
                "gave_up": self.gave_up}


Progress = Callable[[dict[str, object]], Awaitable[None]]


Waits = list[tuple[PendingFile, int]]  # the files waited for, at the version closed


class Barrier:
    def __init__(
        self, journal: Journal, refused: Callable[[], Awaitable[list[Note]]], *,
        hurry: Callable[[PendingFile], None], release_grace: float,
        staged: Callable[[str], bool] = lambda key: False,
    ) -> None:
        self.journal = journal
        # Whether a key is a temporary name (the staged class): a manifest's
        # barrier does not wait for those (they are not the checkpoint's files
        # until renamed, and waiting would upload them under their temp names).
        self.staged = staged
        self.refused = refused  # notes of files that failed for good (a disk read)
        self.hurry = hurry  # end a file's quiet delay: a barrier waits for no timer
        self.release_grace = release_grace

    def snapshot(
        self, prefix: str, out: FlushOutcome, *, exclude: frozenset[str] = frozenset(),
        manifest: bool = False,
    ) -> Waits:
        """The files under `prefix` closed by now and not in the store yet (for a
        manifest's barrier, not those under temporary names)."""
        waits: Waits = []
        for pf in self.journal.under(prefix):
            if pf.key in exclude or not (pf.local or pf.sealed):
                continue  # nothing of it is only here
            if manifest and self.staged(pf.key):
                continue
            if pf.sessions and not all(s.closed for s in pf.sessions):
                out.still_open.append(pf.key)
            elif pf.sealed or pf.sessions:
                waits.append((pf, pf.version))
        return waits

    async def flush(
        self,
        prefix: str = "",
        *,
        exclude: frozenset[str] = frozenset(),
        stall: float | None = None,
        progress: Progress | None = None,
        manifest: bool = False,
    ) -> FlushOutcome:
        out = FlushOutcome()
        await self.wait(self.snapshot(prefix, out, exclude=exclude, manifest=manifest), out,
                        stall=stall, progress=progress)
        failed = {f["key"] for f in out.failed}
        for note in await self.refused():
            if note.kind in FAILED_KINDS and note.key.startswith(prefix) and note.key not in failed:
                out.failed.append({"key": note.key, "reason": note.reason})
        return out

    async def wait(
        self, waits: Waits, out: FlushOutcome, *, stall: float | None = None,
        progress: Progress | None = None,
    ) -> None:
        """Until every file of `waits` landed or ended otherwise (noted in `out`), or
        nothing moved for `stall` seconds."""
        started = trio.current_time()
        moved_at, figure, reported = started, None, started
        while waits:
            now = trio.current_time()
            waits = [w for w in waits if not self._settled(*w, out, now - started)]
            if not waits:
                break
            for pf, _ in waits:  # (again: a RELEASE that came since started a delay)
                self.hurry(pf)
            now_figure = (len(waits), sum(pf.uploaded for pf, _ in waits))
            if now_figure != figure:
                figure, moved_at = now_figure, now
            if stall is not None and now - moved_at > stall:
                out.gave_up = True
                out.waiting = [pf.describe() for pf, _ in waits]
                break
            if progress is not None and now - reported >= PROGRESS_EVERY:
                reported = now
                await progress({"waiting": [pf.describe() for pf, _ in waits],
                                "landed": len(out.landed)})
            with trio.move_on_after(POLL):
                await self.journal.wait_change()

    def _settled(self, pf: PendingFile, version: int, out: FlushOutcome, waited: float) -> bool:
        """Whether the barrier is done with `pf` (noting how it ended)."""
        if pf.landed_version >= version:
            out.landed.append(pf.key)
            return True
        if pf.gone.is_set():
            if pf.outcome in FAILED_KINDS:
                out.failed.append({"key": pf.key, "reason": pf.error or "refused by the store"})
            return True  # otherwise dropped, unlinked, replaced: nothing to land
        if pf.version != version:
            return True  # written again since: a newer version, not one closed before
        if pf.sessions and waited > self.release_grace:
            out.still_open.append(pf.key)  # open elsewhere (a dup'd descriptor): not ours
            return True
        return False
