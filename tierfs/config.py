"""MountConfig and its loading: the only place defaults live.

Everything tunable is here with its default; CLI flags and the TOML config
file override these, nothing else invents a default.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1 << 40, "p": 1 << 50}


class ConfigError(ValueError):
    """A bad option value; the message is shown to the user as one line."""


def parse_size(text: str | int) -> int:
    """'10G', '512MiB', '1.5T', 4096 -> bytes (binary units, as `du -h` prints)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ConfigError(f"invalid size {text!r}: expected e.g. 512M, 20G, 1T")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_seconds(text: str | float | int) -> float:
    """'30', '2.5', 'inf' -> seconds; 'inf' means never expire."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        try:
            value = float(text.strip().removesuffix("s"))
        except ValueError:
            raise ConfigError(f"invalid duration {text!r}: expected seconds or 'inf'") from None
    if value < 0 or math.isnan(value):
        raise ConfigError(f"invalid duration {text!r}: must be >= 0")
    return value


@dataclass(frozen=True)
class ClassSettings:
    """The contract of one path class (DESIGN §2)."""

    name: str
    attr_ttl: float  # kernel + tierfs attribute cache lifetime, seconds
    list_ttl: float  # directory listing cache lifetime, seconds
    revalidate_on_open: bool  # HEAD/conditional GET on every lookup and open
    keep_cache: bool  # keep kernel page cache across opens
    write_mode: str  # "writeback" | "writethrough"
    readahead_max: int  # bytes; 0 disables readahead for the class


DEFAULT_CLASSES: dict[str, ClassSettings] = {
    "dataset": ClassSettings(
        "dataset", attr_ttl=300.0, list_ttl=300.0, revalidate_on_open=False,
        keep_cache=True, write_mode="writethrough", readahead_max=256 * MiB,
    ),
    "checkpoint": ClassSettings(
        "checkpoint", attr_ttl=60.0, list_ttl=60.0, revalidate_on_open=False,
        keep_cache=True, write_mode="writeback", readahead_max=256 * MiB,
    ),
    "manifest": ClassSettings(
        "manifest", attr_ttl=0.0, list_ttl=0.0, revalidate_on_open=True,
        keep_cache=False, write_mode="writethrough", readahead_max=8 * MiB,
    ),
    "default": ClassSettings(
        "default", attr_ttl=10.0, list_ttl=10.0, revalidate_on_open=False,
        keep_cache=True, write_mode="writethrough", readahead_max=256 * MiB,
    ),
}

# Ordered (glob, class); first match wins. A glob without '/' matches the
# basename, one with '/' the whole path ('**' spans directories).
DEFAULT_RULES: tuple[tuple[str, str], ...] = (
    (".metadata", "manifest"),
    ("*.index.json", "manifest"),
    ("latest", "manifest"),
    ("LATEST", "manifest"),
    ("*.manifest", "manifest"),
    ("_SUCCESS", "manifest"),
    ("config.json", "manifest"),
    ("*.distcp", "checkpoint"),
    ("*.pt", "checkpoint"),
    ("*.pth", "checkpoint"),
    ("*.ckpt", "checkpoint"),
    ("*.safetensors", "checkpoint"),
    ("**/checkpoints/**", "checkpoint"),
    ("*.tar", "dataset"),
    ("*.tfrecord", "dataset"),
    ("*.parquet", "dataset"),
    ("*.arrow", "dataset"),
    ("*.bin", "dataset"),
    ("*.idx", "dataset"),
)


def default_cache_root() -> Path:
    if os.geteuid() == 0:
        return Path("/var/cache/tierfs")
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "tierfs"


def cache_dir_for(source: str, endpoint_url: str | None) -> Path:
    """Per-source default cache dir, so a remount of the same source reuses it."""
    digest = hashlib.sha256(f"{endpoint_url or ''}|{source}".encode()).hexdigest()[:16]
    return default_cache_root() / digest


@dataclass
class MountConfig:
    source: str
    mountpoint: Path
    cache_dir: Path | None = None  # None: cache_dir_for(source, endpoint)
    cache_size: int | None = None  # None: 80% of the cache filesystem's free space at mount
    endpoint_url: str | None = None
    foreground: bool = False
    allow_other: bool = False
    log_level: str = "info"

    # store
    part_size: int = 8 * MiB
    max_parallel_gets: int = 16
    max_parallel_puts: int = 8
    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    deadline: float = 30.0  # per store operation, retries included
    mount_check_timeout: float = 8.0  # how long `tierfs mount` waits for the store

    # cache
    chunk_size: int = 1 * MiB
    min_free: int = 1 * GiB  # free-space floor on the cache filesystem

    # read path
    readahead_min: int = 1 * MiB
    readahead_max: int = 256 * MiB
    max_inflight_bytes: int = 128 * MiB  # global cap on bytes being fetched
    kernel_read_ahead_kb: int = 1024  # bdi read_ahead_kb: 1 MiB FUSE reads
    # Model-like files are fetched whole into tier 1 on first open, so mmap
    # page faults (4 KiB, in tensor order) hit local disk, not the store.
    prefetch_globs: tuple[str, ...] = ("*.safetensors", "*.pt", "*.pth", "*.bin")
    prefetch_min_size: int = 64 * MiB

    rules: tuple[tuple[str, str], ...] = DEFAULT_RULES
    classes: dict[str, ClassSettings] = field(default_factory=lambda: dict(DEFAULT_CLASSES))
    default_class: str = "default"

    def resolved_cache_dir(self) -> Path:
        return self.cache_dir or cache_dir_for(self.source, self.endpoint_url)

    def with_overrides(self, **kw: object) -> MountConfig:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})
