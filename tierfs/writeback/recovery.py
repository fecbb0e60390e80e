"""After a restart (DESIGN §5): every sealed write-back file uploads again, every
manifest whose barrier was journaled publishes once that barrier landed; what
a close never finished (dirty, or sealed but waiting for the store) is
quarantined, never uploaded half-written."""

from __future__ import annotations

import logging

from tierfs.cache import Cache
from tierfs.policy import Policy
from tierfs.posix import Known
from tierfs.workers import Workers
from tierfs.writeback.journal import Journal
from tierfs.writeback.pending import Condition
from tierfs.writeback.publish import Publisher
from tierfs.writeback.quarantine import UNCHECKED, Quarantine
from tierfs.writeback.streaming import Streams
from tierfs.writeback.uploader import Uploader

log = logging.getLogger(__name__)


class Recovery:
    def __init__(self, journal: Journal, cache: Cache, policy: Policy, workers: Workers,
                 quarantine: Quarantine, uploader: Uploader, publisher: Publisher,
                 streams: Streams) -> None:
        self.journal = journal
        self.cache = cache
        self.policy = policy
        self.workers = workers
        self.quarantine = quarantine
        self.uploader = uploader
        self.publisher = publisher
        self.streams = streams

    async def recover(self) -> None:
        await self.streams.recover()
        objs = await self.workers.disk(lambda: list(self.cache.iter_objects()))
        publisher = self.publisher
        records = await self.workers.disk(publisher.records.load)
        manifests = []
        for obj in objs:
            mode = self.policy.settings(obj.key).write_mode
            rec = records.get(obj.key)
            if obj.state == "sealed" and not await self.workers.disk(
                    self.cache.finish_seal, obj.key):
                log.error("%r was closed without fsync and the machine restarted before its "
                          "checksums were taken: quarantined, not uploaded", obj.key)
                await self.workers.disk(
                    self.quarantine.keep, obj.key, UNCHECKED,
                    "closed without fsync; the machine restarted before its checksums were "
                    "taken, so a torn copy cannot be told from a whole one: not uploaded")
            elif obj.state == "sealed" and (mode == "writeback" or obj.key.endswith("/")):
                pf = self.journal.track(obj.key, obj.size, obj.mtime)
                pf.mark_resumed(obj.size)
                known = Known.unpack((await self.workers.disk(
                    self.cache.attrs_of, [obj.key])).get(obj.key, b""))
                pf.take_attrs(known.attrs if known is not None and not known.etag else None)
                log.info("resuming upload of %r (%d bytes) sealed before a restart", obj.key, obj.size)
                self.uploader.kick(pf)
            elif obj.state == "sealed" and mode == "publish" and rec is not None:
                manifests.append((obj, records.pop(obj.key)))
            elif obj.state == "sealed":
                # Its close was waiting for the store (write-through, or a publish
                # told to wait): publishing it now would skip the barrier and the
                # condition its writer was promised.
                await self.workers.disk(
                    self.quarantine.keep, obj.key, "unfinished",
                    f"its {mode} close had not returned when the daemon stopped: not uploaded")
            elif obj.state == "dirty":
                await self.workers.disk(
                    self.quarantine.keep, obj.key, "never_closed",
                    "written but never closed before the daemon stopped")
        for obj, rec in manifests:  # every upload of its barrier is tracked by now
            pf = self.journal.track(obj.key, obj.size, obj.mtime)
            pf.mark_resumed(obj.size)
            waits = [(b, b.version) for k in rec.get("barrier", [])
                     if (b := self.journal.get(k)) is not None]
            pf.barrier_journaled(waits, rec.get("id"), Condition(
                rec.get("if_match"), bool(rec.get("if_none_match"))))
            log.info("resuming the publish of %r after %d upload(s) of its barrier",
                     obj.key, len(waits))
            publisher.submit(pf)
        for key in records:  # its manifest landed, or went, before the restart
            await self.workers.disk(publisher.records.drop, key)
