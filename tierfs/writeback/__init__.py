"""Everything a writable handle does (DESIGN §5).

  pending.py     a pending file: its state (STORED, WRITTEN, SEALED, UNSAVED, GONE)
                 and the transitions between them, the only place they change
  journal.py     the files not yet in the store, one per key; the namespace's overlay
  lifecycle.py   the owner of a pending file's life: each transition with its tier-1
                 record and what follows (seal, a close's upload, hand-over, drop)
  session.py     WriteSession: write, truncate, flush (close), fsync, release
  core.py        WriteBack: writable opens, and namespace changes that reach the
                 store (truncate by path, attributes, special files, unlink, mkdir, rmdir)
  rename.py      renames: of local files (a journal update), of stored objects,
                 onto a manifest, of directories
  recovery.py    after a restart: sealed files upload again, journaled manifests publish
  pendingops.py  what `tierfs flush|pending|status` ask for
  tier1.py       the write path's side of tier 1 (entries, local writes, fetches)
  transfer.py    one upload: parts from the memory budget, verification, the version check
  uploader.py    background uploads: quiet delays, retries, quarantine, conflicts
  streaming.py   parts sent while a file is still being written
  barrier.py     the flush barrier (tierfs flush, umount, a manifest's publish)
  publish.py     manifests: barrier, then a conditional PUT
  quarantine.py  files kept aside, never uploaded as they are
  records.py     small journaled records (manifests' barriers, open multipart uploads)
"""
