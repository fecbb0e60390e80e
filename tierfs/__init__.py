"""tierfs: object storage mounted as POSIX, with local NVMe as a block cache."""

__version__ = "0.1.0"
