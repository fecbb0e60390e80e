"""The kernel's view of a node's attributes, and setattr's fields as a change:
the pyfuse3 side of POSIX metadata (posix.py, namespace.py), apart from fs.py's
request translation."""

from __future__ import annotations

import stat

import pyfuse3

from tierfs.config import DEGRADED_ATTR_TTL
from tierfs.fuse.tree import AttrChange, Caller
from tierfs.namespace import Namespace, Node


def entry_attributes(ns: Namespace, node: Node) -> pyfuse3.EntryAttributes:
    a = pyfuse3.EntryAttributes()
    p, size = ns.stat(node)
    a.st_ino = node.inode
    a.generation = 0
    a.st_mode = p.mode
    a.st_rdev = p.rdev
    a.st_nlink = ns.nlink(node)
    a.st_uid, a.st_gid = p.uid, p.gid
    a.st_size = size
    a.st_blksize = 1 << 20
    a.st_blocks = (size + 511) // 512
    a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns = p.atime_ns, p.mtime_ns, p.ctime_ns
    ttl = node.settings.attr_ttl
    if ns.health.degraded:
        ttl = min(ttl, DEGRADED_ATTR_TTL)
    elif ns.untyped(node):
        ttl = 0  # the kernel asks again by lookup: that one learns what it is
    a.attr_timeout = a.entry_timeout = min(ttl, 1e6)
    return a


def caller(ctx: pyfuse3.RequestContext) -> Caller:
    return Caller(ctx.uid, ctx.gid)


def setattr_change(attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields) -> AttrChange:
    """chmod, chown, utimens as a setattr carries them (UTIME_NOW arrives as a time)."""
    return AttrChange(
        perms=stat.S_IMODE(attr.st_mode) if fields.update_mode else None,
        uid=attr.st_uid if fields.update_uid else None,
        gid=attr.st_gid if fields.update_gid else None,
        atime_ns=attr.st_atime_ns if fields.update_atime else None,
        mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
        ctime_ns=attr.st_ctime_ns if fields.update_ctime else None,
    )
