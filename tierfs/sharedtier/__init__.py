"""The shared tier: an S3-compatible bucket near the nodes, between tier 1 and the
origin (DESIGN §1b), so that a herd of nodes reading one model costs the origin
one copy.

  blocks.py  block names (origin identity, key, ETag, block size, index) and
             their checksums (xxh3-128, or HMAC-SHA-256 with a fleet secret)
  claims.py  claims and leases: single-flight across nodes through the
             store's conditional create, with takeover when a lease runs out
  tier.py    SharedTier: the source the read path's fetcher asks per block
  setup.py   opening it before the mount: credentials, secret, probe

The shared tier is a cache, never the truth: the namespace's ETag (from the
origin's listing or HEAD) names the blocks, writes go to the origin only, and
cleanup is the bucket's lifecycle rule.
"""

from tierfs.sharedtier.blocks import BlockRef, Blocks
from tierfs.sharedtier.claims import BlockFlight, Counts, Outcome
from tierfs.sharedtier.setup import SharedStore, open_shared, origin_of
from tierfs.sharedtier.tier import SharedTier

__all__ = [
    "BlockFlight",
    "BlockRef",
    "Blocks",
    "Counts",
    "Outcome",
    "SharedStore",
    "SharedTier",
    "open_shared",
    "origin_of",
]
