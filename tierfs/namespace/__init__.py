"""Inodes, dentries and the attribute/listing cache (DESIGN §6).

Directories are key prefixes, files are objects. What a listing or HEAD
taught us is trusted for the class TTL of each entry; strict (manifest)
paths are re-checked against the store on every lookup.

  nodes.py       the inode table (stable inode numbers, names a key may carry)
  attributes.py  POSIX attributes: what is known of each node, and from where
  listings.py    listings: fetched, shared, kept across remounts, degraded mode
  changes.py     what this mount changes (create, remove, rename, uploads)
  dirattrs.py    a directory's attribute object: what a listing cannot tell
  attrobjects.py attribute objects read for listings, written for changes
  namespace.py   the face the rest of tierfs calls
"""

from tierfs.namespace.namespace import Namespace
from tierfs.namespace.nodes import ROOT_INODE, LocalOverlay, Node, join, valid_name

__all__ = ["ROOT_INODE", "LocalOverlay", "Namespace", "Node", "join", "valid_name"]
