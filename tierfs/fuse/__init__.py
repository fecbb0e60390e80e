"""The kernel side of a mount (DESIGN §8, §9): the only package that imports pyfuse3.

  fs.py          pyfuse3.Operations: translates requests and errnos, no policy
  fs_attrs.py    a node's attributes as the kernel sees them; setattr as a change
  tree.py        namespace changes (create, mkdir, rename, unlink...) a request makes
  modes.py       which way each open is served: FUSE passthrough or the daemon path
  passthrough.py whether the mount can use passthrough; backing files per inode
  kernel.py      dropping what the kernel caches; the size of its read requests
  fusermount.py  what is mounted where, unmounting (no pyfuse3: `tierfs umount`
                 imports it and must start fast)
"""
