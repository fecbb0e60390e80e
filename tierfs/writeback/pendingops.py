"""What `tierfs flush|pending|status` ask of the write path (ops.py calls these):
the barrier, figures, files kept aside, and discarding or retrying one."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

from tierfs.workers import Workers
from tierfs.writeback.barrier import Barrier, FlushOutcome, Progress
from tierfs.writeback.journal import Journal
from tierfs.writeback.lifecycle import Lifecycle
from tierfs.writeback.pending import DISCARDED
from tierfs.writeback.quarantine import Conflicts, Note, Quarantine

log = logging.getLogger(__name__)


class PendingOps:
    def __init__(self, journal: Journal, life: Lifecycle, barrier: Barrier,
                 quarantine: Quarantine, conflicts: Conflicts, workers: Workers) -> None:
        self.journal = journal
        self.life = life
        self.barrier = barrier
        self.quarantine = quarantine
        self.conflicts = conflicts
        self.workers = workers

    async def flush(
        self, prefix: str = "", *, stall: float | None = None, progress: Progress | None = None
    ) -> FlushOutcome:
        return await self.barrier.flush(prefix, stall=stall, progress=progress)

    def summary(self, prefix: str = "") -> dict[str, object]:
        # (checksums of every sealed file, not only those under `prefix`)
        return self.journal.summary(prefix) | {"checksums_pending": self.life.uploader.digesting}

    async def notes(self) -> list[Note]:
        """Files kept aside: quarantined, and manifests whose background publish lost its race."""
        return await self.workers.disk(lambda: self.quarantine.notes() + self.conflicts.notes())

    async def pending(self, prefix: str = "") -> dict[str, object]:
        """What `tierfs pending list` shows: files here only, and files kept aside."""
        files = [pf.describe() for pf in self.journal.under(prefix) if pf.local]
        notes = [asdict(n) for n in await self.notes() if n.key.startswith(prefix)]
        return {"files": files, "quarantined": notes}

    async def discard(self, key: str) -> str:
        """Forget a quarantined file, or a pending one's local bytes. What was done."""
        note = await self.workers.disk(self.quarantine.find, key)
        if note is not None:
            await self.workers.disk(self.quarantine.discard, note)
            return "discarded from quarantine"
        note = await self.workers.disk(self.conflicts.find, key)
        if note is not None:
            await self.workers.disk(self.conflicts.discard, note)
            return "conflict discarded (its bytes were never published)"
        pf = self.journal.get(key)
        if pf is None or not pf.local:
            raise FileNotFoundError(f"{key}: nothing pending or quarantined")
        if pf.sessions:
            raise OSError(f"{key}: open for writing; close it first")
        async with self.life.settled(pf):
            await self.life.drop(pf, DISCARDED)
        log.warning("discarded the local bytes of %r (never uploaded), on request", key)
        return "local bytes discarded, not uploaded"

    async def retry(self, key: str) -> str:
        """Upload a quarantined file again, or a pending one now (not after its backoff)."""
        note = await self.workers.disk(self.quarantine.find, key)
        if note is not None:
            entry = await self.workers.disk(self.quarantine.restore, note)
            await self.life.tier1.release(entry)
            pf = self.journal.track(key, entry.size, time.time())
            pf.mark_resumed(entry.size)
            self.life.uploader.kick(pf)
            log.info("retrying the upload of quarantined %r, on request", key)
            return "back in the upload queue"
        pending = self.journal.get(key)
        if pending is None or not pending.sealed:
            raise FileNotFoundError(f"{key}: nothing pending or quarantined")
        pending.nudge()
        self.life.uploader.kick(pending)
        return "retried now"
