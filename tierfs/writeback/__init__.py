"""Everything a writable handle does (DESIGN §5).

  core.py        WriteBack: opens write sessions, namespace changes that reach the
                 store (unlink, mkdir, rmdir, rename), recovery, `tierfs pending`
  session.py     WriteSession: write, truncate, flush (close), fsync, release;
                 WriteContext: what every session shares
  journal.py     the files not yet in the store, one record per key
  queue.py       direct writes, acknowledged before tier 1 has them
  uploader.py    uploads: parts from the memory budget, retries, verification
  barrier.py     the flush barrier (tierfs flush, umount, a manifest's publish)
  publish.py     manifests: barrier, then a conditional PUT
  quarantine.py  files kept aside, never uploaded as they are
"""
