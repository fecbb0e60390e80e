"""Shared-tier block names and their checksums (pure: no I/O).

A block is `block_size` bytes of one version of one origin object, named by
what makes it immutable: the origin's bucket, the object's full key, its ETag,
the block size and the block's index. A new ETag is a new name, so a block of
an old version is never even looked up for a new one.

Each block object carries one checksum in its user metadata, over a header
that spells out that whole identity (and the object's size) followed by the
block's bytes. A reader recomputes it over the bytes it took and serves them
only if it matches. Two kinds:

- `xxh3-128`: written by whichever node fetched the block from the origin (its
  GET pinned to the ETag). It catches a torn or truncated put, bit rot, bytes
  overwritten without the matching metadata, and a valid block copied under
  another name (another object, version or index). It does NOT stop a party
  with write access to the shared bucket from putting other bytes together
  with their checksum: integrity, not authenticity. (A cryptographic hash would
  not change that, since such a party could compute it as well; xxh3 costs a
  node ~0.1 s of CPU per GiB where SHA-256 cost 0.7 s.)
- `hmac-sha256`, when the mount has a shared secret ([shared] secret_file): the
  same over a key only the nodes hold. A party that can write the bucket but
  does not hold the secret cannot make any node serve its bytes.

The origin cannot vouch for a block by itself: S3's ETag is an MD5 of the whole
object (or of its parts) at best, and tierfs's own whole-object digest
(`tierfs-xxh3tree`) is xxh3, fast but not resistant to a deliberate forger.
A fleet with a secret uses a namespace of its own (`k<key id>`), so fleets
with different secrets, or none, never take each other's blocks for corrupt.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass

import xxhash

VERSION = "v1"
SUM_META = "tierfs-sum"  # user metadata key of a block's checksum
_ETAG_OK = re.compile(r"^[A-Za-z0-9-]{1,80}$")


@dataclass(frozen=True)
class BlockRef:
    """Block `index` of version `etag` of object `key` of origin `source`."""

    source: str  # the origin's bucket: s3://BUCKET (its endpoint left out: see tier.py)
    key: str  # the object's full key in it
    etag: str
    size: int  # the object's size
    block_size: int
    index: int

    @property
    def start(self) -> int:
        return self.index * self.block_size

    @property
    def length(self) -> int:
        return min(self.block_size, self.size - self.start)

    def identity(self) -> bytes:
        """Everything the block's name stands for, unambiguously encoded."""
        return json.dumps(
            [VERSION, self.source, self.key, self.etag, self.size, self.block_size, self.index],
            ensure_ascii=False,
        ).encode("utf-8", "surrogateescape")


class Blocks:
    """Names and checksums of one fleet's blocks (relative to the shared tier's
    bucket and prefix, which its store adapter owns)."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret
        if secret is None:
            self.space = VERSION
        else:
            key_id = hashlib.sha256(b"tierfs shared key id\0" + secret).hexdigest()[:12]
            self.space = f"{VERSION}-k{key_id}"

    @property
    def authenticated(self) -> bool:
        return self._secret is not None

    def name(self, ref: BlockRef) -> str:
        """The block object's key: short, fixed-depth, and one per identity."""
        src = hashlib.sha256(ref.source.encode("utf-8", "surrogateescape")).hexdigest()[:16]
        obj = hashlib.sha256(ref.key.encode("utf-8", "surrogateescape")).hexdigest()[:32]
        etag = ref.etag if _ETAG_OK.match(ref.etag) else (
            "h" + hashlib.sha256(ref.etag.encode("utf-8", "surrogateescape")).hexdigest()[:32])
        return f"{self.space}/{src}/{obj}/{etag}/{ref.block_size}/{ref.index}"

    def claim_name(self, ref: BlockRef) -> str:
        return self.name(ref) + ".claim"

    def checksum(self, ref: BlockRef, data: bytes | memoryview) -> str:
        """The metadata value for `data` as block `ref` (hashlib and hmac release the
        GIL over the bytes: callers run this in a worker thread)."""
        if self._secret is None:
            h = xxhash.xxh3_128(ref.identity())
            h.update(data)
            return "xxh3-128:" + h.hexdigest()
        m = hmac.new(self._secret, ref.identity(), "sha256")
        m.update(data)
        return "hmac-sha256:" + m.hexdigest()

    def verifies(self, ref: BlockRef, data: bytes | memoryview, metadata: dict[str, str]) -> bool:
        """Whether `data` is block `ref` as its metadata's checksum says, of this
        fleet's kind (a secret fleet never accepts an unkeyed checksum)."""
        want = metadata.get(SUM_META)
        if want is None or len(data) != ref.length:
            return False
        return hmac.compare_digest(want, self.checksum(ref, data))
