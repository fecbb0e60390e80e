"""MountConfig and its loading: the only place defaults live.

Everything tunable is here with its default; CLI flags and the TOML config
file override these, nothing else invents a default.

Which constants are settings, and which are not (the one rule): a value a
deployment would choose differently (a size, a timeout, a delay, a degree of
concurrency, a class contract) is a setting, here, with its default. A
constant elsewhere is not a setting, and is one of:
  - a fact of a protocol or the platform (S3's 10,000 parts and 5 MiB parts,
    NAME_MAX, a symlink's length, O_DIRECT alignment, the kernel's and
    libfuse's versions for passthrough, on-disk format versions);
  - the tuning of one mechanism, whose right value follows from the mechanism
    and was measured on this machine kind, not from the deployment (batch and
    coalescing sizes, poll and gather intervals, hash and readahead shares,
    allocator and GC thresholds): it stays beside the code it tunes, with the
    measurement that chose it;
  - the pacing of the command line's output.
A constant that turns out to differ between deployments moves here.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import os
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from tierfs.errors import ConfigError
from tierfs.globs import glob_to_regex

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1 << 40, "p": 1 << 50}


def parse_size(text: str | int) -> int:
    """'10G', '512MiB', '1.5T', 4096 -> bytes (binary units, as `du -h` prints)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ConfigError(f"invalid size {text!r}: expected e.g. 512M, 20G, 1T")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human_size(n: float) -> str:
    """Bytes as `du -h` would print them (binary units): 512.0 MiB, 1.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


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
    # "writeback": close returns once sealed locally, upload follows;
    # "writethrough": close returns once the store has it;
    # "publish": barrier (every upload pending in the directory subtree lands
    # first) + conditional PUT (If-Match / If-None-Match: *); see `publish`.
    write_mode: str
    readahead_max: int  # bytes; 0 disables readahead for the class
    # Write-only opens bypass the kernel page cache (FOPEN_DIRECT_IO): each
    # write(2) reaches the daemon as is, one copy less than the page cache's
    # write-back; large writes (checkpoints: 1 MiB+) are faster, small ones
    # (< 64 KiB) slower, a round trip each. Read-write opens (mmap) keep it.
    direct_writes: bool = False
    # Write-back: seconds a closed file stays quiet before its upload starts, so
    # that a rename, unlink or reopen right after close costs no upload (a
    # temporary name's grace period is this too). flush/umount do not wait it.
    upload_delay: float = 0.0
    # Publish: "background": close/rename return once the manifest and its
    # barrier are journaled here, the conditional PUT follows; "wait": they
    # return once it is published (ESTALE at close for a lost race).
    publish: str = "background"
    # A lookup of a small object (<= posix.SYMLINK_MAX bytes) whose POSIX
    # attributes are unknown asks the store (one HEAD): it may be a symlink or a
    # FIFO another node made. Off for datasets: a listing answers them (0 HEADs).
    type_small_objects: bool = True
    # Listings of this class's directories are kept in the tier-1 index and a
    # later mount takes them within list_ttl (no LIST of a big dataset directory
    # after a remount); other classes list again after a remount.
    keep_listings: bool = False
    # Write-back: parts of a file written front to back go up while it is being
    # written (writeback/streaming.py; through FUSE passthrough too: the daemon
    # follows the file's length), so after close only its tail is left. Off by
    # default, by measurement on the 2-core bench VM, where SeaweedFS takes both
    # cores during any upload (boto3's upload_file leaves 2% idle): with it the
    # checkpoint reaches the bucket sooner (1 GiB dd conv=fsync: 7.29 vs 7.91 s;
    # with uploads limited to 800 Mbit/s, a store behind a link: 11.72 vs 12.70 s,
    # 1.04x boto3) but the writer waits longer where the cores are shared (dd
    # 1.38 vs 1.20 s; dcp.save 1.51x ext4 vs 1.05x; Content-MD5 of each part
    # costs 1.6 CPU-s per GiB). bench/ckptwrite.py --stream [--store-rate],
    # bench/mlworkloads.py --tierfs-config. A node with cores to spare next to
    # a remote store gains.
    stream_parts: bool = False


# The largest per-stream readahead window of the bulk classes. It matches the
# default max_inflight: the read path keeps as many just-fetched bytes in memory
# (read/reader.py, read/landed.py), so a sequential reader is served from memory; bytes
# fetched further ahead than that are read back from tier 1 (a device read per
# request: 384 vs 609 MB/s cold with 256 vs 64 MiB on the bench VM).
READAHEAD = 64 * MiB

# While the store is away: listings answered from the tier-1 index are retried
# against the store after this many seconds, and the store is probed as often.
DEGRADED_RETRY = 5.0

# FUSE requests served at once (pyfuse3.main min_tasks, max_tasks), and reply
# buffers of big reads kept for reuse (about the kernel's max_background reads).
FUSE_TASKS = (4, 64)
SERVE_BUFFERS_KEPT = 64

# While the store is away, the kernel caches attributes no longer than this.
DEGRADED_ATTR_TTL = 5.0
LOG_EVERY = 10.0  # seconds between log lines of one kind of error returned to callers

# Store access. A ranged GET or upload part: each request costs ~2 ms of botocore
# CPU and the server its own share: 16 MiB parts read a cold 2 GiB object at
# 0.78x raw boto3 where 8 MiB parts managed 0.71x (bench VM, 3 runs each).
PART_SIZE = 16 * MiB
CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 30.0
DEADLINE = 30.0  # per store operation, retries included
MAX_CONNECTIONS = 64  # HTTP connections kept to the store (>= worker threads that use it)

# Write-back: a closed file's quiet delay before its upload, and the grace
# period of a file under a temporary name (never renamed: uploaded as is).
QUIET_DELAY = 1.0
TEMP_GRACE = 30.0

# Tier 1.
CHUNK_SIZE = 1 * MiB

# The shared tier (sharedtier/): blocks of one part each (a 1 GiB model is 64
# blocks), and how long a node waits for another node's claim on a block
# before fetching it itself (well above one block's fetch over a slow link).
SHARED_BLOCK = PART_SIZE
SHARED_LEASE = 30.0
# Blocks a node fetches from the origin at once through the shared tier (with
# one more claimed, ready to start: sharedtier/slots.py). A herd of N keeps N x
# this many on the origin link, landing in the order they are read. Over one
# narrow link the herd shares, fewer pace it better (bench/sharedtier.py, 4
# nodes, 1 GiB over 400 Mbit/s: slowest node 1.36x one alone with 1, about
# 1.6x with 4); but a node with its own link to an in-region store, or alone,
# needs several streams to fill it (one S3 stream is ~100 MB/s), and the
# herd's nodes each have one. 4 serves that case; set 1 for a herd behind
# one narrow link.
SHARED_ORIGIN_FETCHES = 4

# Directories' attribute objects (namespace/dirattrs.py): this mount's changes of
# one directory are written at most every DIR_ATTRS_DELAY seconds plus a second
# per DIR_ATTRS_PER_SECOND entries the object holds (cp -a of 10,000 files
# rewrites its directory's object a few dozen times, not 10,000); tables of at
# most DIR_ATTRS_CACHED entries in all are held in memory.
DIR_ATTRS_DELAY = 1.0
DIR_ATTRS_PER_SECOND = 5000
DIR_ATTRS_CACHED = 200_000

# Uploads. A failed upload is retried with backoff up to this many seconds apart
# (sooner once the store answers again); one that lands but does not verify is
# retried this many times, then quarantined.
UPLOAD_RETRY_CAP = 30.0
UPLOAD_VERIFY_ATTEMPTS = 3

# The flush barrier (tierfs flush, umount): a file closed just before it started
# gets this long for its RELEASE (which the kernel sends after close(2)
# returned); a flush gives up once nothing moved for FLUSH_STALL seconds.
RELEASE_GRACE = 3.0
FLUSH_STALL = 60.0

# The longest object key (source prefix included) the store takes: S3 and
# SeaweedFS refuse 1,025 bytes (KeyTooLongError). Names whose key would be
# longer are refused with ENAMETOOLONG before anything is written.
MAX_KEY_BYTES = 1024

# Tier 1's size, unless configured, and its free-space floor (cache/sizing.py).
CACHE_SHARE_OF_FREE = 0.8  # of the cache filesystem's free space at mount
MIN_FREE_DEFAULT = 1 * GiB  # the floor...
MIN_FREE_SHARE = 0.05  # ...but at most this share of the filesystem (small disks)
# Smallest tier 1 a mount accepts: two chunks, so a 1 MiB read that crosses a
# chunk boundary fits (smaller ones are typos, like "--cache-size 64K").
MIN_CACHE_SIZE = 2 * MiB

# Bytes of direct writes acknowledged but not yet in tier 1, per mount
# (queued_writes.py): enough to keep a 1 MiB writer from waiting on the apply.
QUEUED_WRITES = 32 * MiB

DEFAULT_CLASSES: dict[str, ClassSettings] = {
    "dataset": ClassSettings(
        "dataset", attr_ttl=300.0, list_ttl=300.0, revalidate_on_open=False,
        keep_cache=True, write_mode="writeback", readahead_max=READAHEAD,
        upload_delay=QUIET_DELAY,
        type_small_objects=False,
        keep_listings=True,
    ),
    "checkpoint": ClassSettings(
        "checkpoint", attr_ttl=60.0, list_ttl=60.0, revalidate_on_open=False,
        keep_cache=True, write_mode="writeback", readahead_max=READAHEAD, direct_writes=True,
    ),
    "manifest": ClassSettings(
        "manifest", attr_ttl=0.0, list_ttl=0.0, revalidate_on_open=True,
        keep_cache=False, write_mode="publish", readahead_max=8 * MiB,
    ),
    "default": ClassSettings(
        "default", attr_ttl=10.0, list_ttl=10.0, revalidate_on_open=False,
        keep_cache=True, write_mode="writeback", readahead_max=READAHEAD,
        upload_delay=QUIET_DELAY,
    ),
    # Temporary names (DESIGN §2): kept here, not uploaded under that name; a
    # rename re-keys them (the new name's class applies), the grace period
    # uploads one left alone.
    "staged": ClassSettings(
        "staged", attr_ttl=10.0, list_ttl=10.0, revalidate_on_open=False,
        keep_cache=True, write_mode="writeback", readahead_max=READAHEAD,
        direct_writes=True, upload_delay=TEMP_GRACE,
    ),
}

# Ordered (glob, class); first match wins. A glob without '/' matches the
# basename, one with '/' the whole path ('**' spans directories).
DEFAULT_RULES: tuple[tuple[str, str], ...] = (
    # Temporary names first: `x.pt.tmp` is not a checkpoint yet. `.tmp??????`:
    # Rust's tempfile crate (safetensors); `tmp????????`: Python's tempfile.
    ("*.tmp", "staged"),
    ("*.tmp.*", "staged"),
    (".*.tmp", "staged"),
    ("*.partial", "staged"),
    ("*.incomplete", "staged"),
    ("*~", "staged"),
    (".tmp??????", "staged"),
    ("tmp????????", "staged"),
    ("tmp????????.*", "staged"),
    # Hugging Face Trainer (transformers 4.36) wrote a checkpoint into this
    # directory, then renamed it to checkpoint-N: uploads begun under it were
    # stopped by the rename (in-flight parts finished first: 1.8 s of a 1 GiB
    # checkpoint's rename) or copied server-side.
    ("**/tmp-checkpoint-*/**", "staged"),
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
    # Samples: a directory of images, audio, video or arrays is a dataset (its
    # listing is kept across remounts: kept_listings.listing_settings).
    ("*.jpg", "dataset"),
    ("*.jpeg", "dataset"),
    ("*.JPEG", "dataset"),  # ImageNet's spelling
    ("*.JPG", "dataset"),
    ("*.png", "dataset"),
    ("*.webp", "dataset"),
    ("*.wav", "dataset"),
    ("*.flac", "dataset"),
    ("*.mp3", "dataset"),
    ("*.mp4", "dataset"),
    ("*.npy", "dataset"),
    ("*.npz", "dataset"),
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


def default_memory_budget() -> int:
    """A sixteenth of the machine's memory, within [256 MiB, 2 GiB]. A fixed 256 MiB
    held about two cold streams: with more, the budget reclaimed just-fetched
    parts before they were read, and each read loaded them back from tier 1.
    bench/engine.py --size 1G --runs 3 --files 10000, 2026-12-07, 2-core VM with
    24 GiB (1.5 GiB budget), load 6-8: 4 readers of 4 cold 1 GiB objects 14.82 s
    (256 MiB: 21.10 s; 4 bare awscrt GETs: 17.95 s), Python CPU 2.86 s per GiB
    (5.20); one reader unchanged (2.29-2.52 s vs 2.53-2.74 s, 3 quiet pairs)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(2 * GiB, max(256 * MiB, ram // 16))


def default_inflight(budget: int) -> int:
    """Bytes of GETs in flight (and of just-fetched parts kept) by default: a
    quarter of the memory budget, within [64 MiB, 512 MiB]."""
    return min(512 * MiB, max(64 * MiB, budget // 4))


@dataclass
class MountConfig:
    source: str
    mountpoint: Path
    cache_dir: Path | None = None  # None: cache_dir_for(source, endpoint)
    cache_size: int | None = None  # None: CACHE_SHARE_OF_FREE of the cache filesystem's free space
    endpoint_url: str | None = None
    foreground: bool = False
    allow_other: bool = False
    nonempty: bool = False  # mount over a directory that has files (hiding them)
    # Publish manifests with plain PUTs on a store that ignores conditional
    # writes (losing the lost-race detection; the barrier still holds).
    allow_unsafe_manifests: bool = False
    log_level: str = "info"
    config_file: Path | None = None  # the TOML file the settings came from, if any
    # Prometheus text endpoint ("HOST:PORT"); off when None. Loopback only
    # unless metrics_allow_remote.
    metrics_addr: str | None = None
    metrics_allow_remote: bool = False
    # What objects of unknown POSIX attributes show (objects written by other
    # tools; listings carry no metadata): owner (None: the mounting user) and modes.
    uid: int | None = None
    gid: int | None = None
    file_mode: int = 0o644
    dir_mode: int = 0o755
    # FUSE passthrough for files complete in tier 1 (DESIGN §3.8), where the
    # kernel, libfuse and privileges allow it; it turns the kernel's write-back
    # cache off (they exclude each other). False: daemon path only, write-back
    # cache on.
    passthrough: bool = True

    # store
    # What moves the bytes of GETs and uploads: "crt" (the AWS Common Runtime,
    # store/crt.py) or "botocore" (the fallback; control calls always use it).
    store_engine: str = "crt"
    part_size: int = PART_SIZE  # ranged GET / multipart part
    max_parallel_gets: int = 16
    max_parallel_puts: int = 8  # upload parts in flight, all uploads together (own slots)
    max_parallel_uploads: int = 2  # files uploading at once
    meta_threads: int = 16  # HEAD/LIST/DELETE/COPY in flight
    disk_threads: int = 8  # tier-1 I/O and index updates in flight
    connect_timeout: float = CONNECT_TIMEOUT
    read_timeout: float = READ_TIMEOUT
    deadline: float = DEADLINE
    max_key_bytes: int = MAX_KEY_BYTES

    # Every byte held in flight (GET buffers, landed parts, FUSE read replies,
    # upload part buffers, queued writes), shared by reads and uploads (budget.py).
    memory_budget: int = field(default_factory=default_memory_budget)

    # cache
    chunk_size: int = CHUNK_SIZE
    # Free-space floor on the cache filesystem. None: MIN_FREE_DEFAULT, at most
    # MIN_FREE_SHARE of the filesystem.
    min_free: int | None = None

    # read path
    readahead_min: int = 1 * MiB
    # Bytes being fetched at once (GETs in flight x part_size); as many bytes of
    # just-fetched parts are kept in memory for the reads that follow them.
    # None: default_inflight(memory_budget).
    max_inflight_bytes: int | None = None
    kernel_read_ahead_kb: int = 1024  # bdi read_ahead_kb: 1 MiB FUSE reads
    # Reads of checked tier-1 bytes answered by libfuse splicing them from the
    # file (fuse/splice.py): "auto" where a pipe can hold a whole reply.
    splice: str = "auto"
    # Model-like files are fetched whole into tier 1 on first open, so mmap
    # page faults (4 KiB, in tensor order) hit local disk, not the store.
    prefetch_globs: tuple[str, ...] = ("*.safetensors", "*.pt", "*.pth", "*.bin")
    prefetch_min_size: int = 64 * MiB
    # Objects up to this size are fetched whole by any read of them and kept in
    # tier 1 like any object (images, clips, JSON of a small-files dataset).
    whole_object_max: int = 1 * MiB

    # shared tier: an S3-compatible bucket near the nodes, asked between tier 1
    # and the origin (off when None). Credentials: the standard chain, unless a
    # profile or keys of its own are named (never logged: not in the repr).
    shared_cache: str | None = None  # s3://BUCKET[/PREFIX]
    shared_endpoint_url: str | None = None
    shared_profile: str | None = None
    shared_access_key_id: str | None = field(default=None, repr=False)
    shared_secret_access_key: str | None = field(default=None, repr=False)
    shared_session_token: str | None = field(default=None, repr=False)
    # A secret the nodes share: blocks are authenticated (HMAC-SHA-256), so a
    # party that can write the bucket but lacks it cannot have blocks served.
    shared_secret_file: Path | None = None
    shared_block_size: int = SHARED_BLOCK
    shared_lease: float = SHARED_LEASE
    shared_origin_fetches: int = SHARED_ORIGIN_FETCHES
    # A loader's next shard fetched (its blocks claimed) ahead of its open (read/prefetch.py).
    shared_claim_ahead: bool = True

    rules: tuple[tuple[str, str], ...] = DEFAULT_RULES
    classes: dict[str, ClassSettings] = field(default_factory=lambda: dict(DEFAULT_CLASSES))
    default_class: str = "default"

    def resolved_cache_dir(self) -> Path:
        return self.cache_dir or cache_dir_for(self.source, self.endpoint_url)

    @property
    def inflight_bytes(self) -> int:
        """`max_inflight_bytes`, or its default for this budget."""
        if self.max_inflight_bytes is not None:
            return self.max_inflight_bytes
        return default_inflight(self.memory_budget)


# -- metrics address -------------------------------------------------------------


def parse_listen_addr(text: str, allow_remote: bool = False) -> tuple[str, int]:
    """'127.0.0.1:9464', '[::1]:9464', 'localhost:9464' -> (host, port).

    Anything that is not loopback is refused unless `allow_remote`: the
    endpoint has no authentication.
    """
    m = re.fullmatch(r"\[([0-9a-fA-F:.]+)\]:(\d+)|([^:\[\]]+):(\d+)", text.strip())
    if not m:
        raise ConfigError(f"invalid metrics address {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9464")
    host = m.group(1) or m.group(3)
    port = int(m.group(2) or m.group(4))
    if not 0 < port < 65536:
        raise ConfigError(f"invalid metrics address {text!r}: port must be 1-65535")
    if host == "localhost":
        loopback = True
    else:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            raise ConfigError(
                f"invalid metrics address {text!r}: host must be an IP address or localhost"
            ) from None
    if not loopback and not allow_remote:
        raise ConfigError(
            f"metrics address {text!r} is not loopback; the endpoint has no authentication "
            "(pass --metrics-allow-remote / metrics.allow_remote = true to expose it anyway)"
        )
    return host, port


# -- TOML config file -----------------------------------------------------------

LOG_LEVELS = ("debug", "info", "warning", "error")
WRITE_MODES = ("writeback", "writethrough", "publish")
PUBLISH_MODES = ("background", "wait")


class ConfigFileError(ConfigError):
    """A problem at a known place of a config file: 'FILE:LINE: reason'."""

    def __init__(self, file: str | Path, line: int, reason: str) -> None:
        super().__init__(f"{file}:{line}: {reason}")
        self.file, self.line, self.reason = str(file), line, reason


class ConfigFileErrors(ConfigError):
    """Several problems of one config file, in file order: one 'FILE:LINE: reason'
    line each (str() joins them with newlines)."""

    def __init__(self, errors: list[ConfigFileError]) -> None:
        self.errors = sorted(errors, key=lambda e: e.line)
        super().__init__("\n".join(str(e) for e in self.errors))


def _want_str(v: Any) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"expected a string, got {type(v).__name__}")
    return v


def _want_bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"expected true or false, got {v!r}")
    return v


def _want_size(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ConfigError(f"expected a size like \"512M\" or a byte count, got {v!r}")
    n = parse_size(v)
    if n < 0:
        raise ConfigError(f"size must not be negative, got {v!r}")
    return n


def _want_pos_size(v: Any) -> int:
    n = _want_size(v)
    if n <= 0:
        raise ConfigError(f"size must be positive, got {v!r}")
    return n


def _want_cache_size(v: Any) -> int:
    n = _want_size(v)
    if n < MIN_CACHE_SIZE:
        raise ConfigError(f"{human_size(n)} is below the minimum of {human_size(MIN_CACHE_SIZE)}")
    return n


def _want_seconds(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ConfigError(f"expected seconds or \"inf\", got {v!r}")
    return parse_seconds(v)


def _want_finite_seconds(v: Any) -> float:
    s = _want_seconds(v)
    if math.isinf(s) or s <= 0:
        raise ConfigError(f"expected a positive number of seconds, got {v!r}")
    return s


def _want_delay(v: Any) -> float:
    s = _want_seconds(v)
    if math.isinf(s):
        raise ConfigError(f"expected a finite number of seconds, got {v!r}")
    return s


def _want_pos_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"expected a positive integer, got {v!r}")
    return v


def _want_level(v: Any) -> str:
    v = _want_str(v).lower()
    if v not in LOG_LEVELS:
        raise ConfigError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {v!r}")
    return v


STORE_ENGINES = ("crt", "botocore")


def _want_engine(v: Any) -> str:
    v = _want_str(v).lower()
    if v not in STORE_ENGINES:
        raise ConfigError(f"store engine must be one of {', '.join(STORE_ENGINES)}, got {v!r}")
    return v


SPLICE_MODES = ("auto", "on", "off")


def _want_splice(v: Any) -> str:
    v = _want_str(v).lower()
    if v not in SPLICE_MODES:
        raise ConfigError(f"read splice must be one of {', '.join(SPLICE_MODES)}, got {v!r}")
    return v


def _want_source(v: Any) -> str:
    v = _want_str(v)
    if not re.match(r"^(s3://[^/]{3,}|file:///)", v):
        raise ConfigError(f"source must be s3://bucket[/prefix] or file:///path, got {v!r}")
    return v


def check_endpoint(url: str) -> str:
    """An S3 endpoint must say its scheme: a bare host:port would make boto3
    fail deep inside the daemon (and guessing http:// could send credentials
    in the clear to what was meant to be https)."""
    m = re.match(r"^(https?)://([^/?#]+)", url.strip())
    if not m:
        hint = f"; write http://{url} or https://{url}" if "://" not in url else ""
        raise ConfigError(f"endpoint URL {url!r} must start with http:// or https://{hint}")
    return url.strip()


def check_shared_cache(url: str) -> str:
    if not re.match(r"^s3://[^/]{3,}", url):
        raise ConfigError(f"shared cache must be s3://BUCKET[/PREFIX], got {url!r}")
    return url


def _want_shared_cache(v: Any) -> str:
    return check_shared_cache(_want_str(v))


def _want_endpoint(v: Any) -> str:
    return check_endpoint(_want_str(v))


def _want_abs_path(v: Any) -> Path:
    v = _want_str(v)
    if not v.startswith("/"):
        raise ConfigError(f"expected an absolute path, got {v!r}")
    return Path(v)


def _want_id(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 0xFFFF_FFFF:
        raise ConfigError(f"expected a numeric user or group id, got {v!r}")
    return v


def _want_octal(v: Any) -> int:
    """A permission mode written as an octal string ("640"), as chmod takes it."""
    if not isinstance(v, str) or not v or set(v) - set("01234567") or int(v, 8) > 0o7777:
        raise ConfigError(f'expected an octal permission mode as a string (e.g. "640"), got {v!r}')
    return int(v, 8)


def _want_globs(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(g, str) and g for g in v):
        raise ConfigError("expected a list of glob strings")
    return tuple(v)


# (table, key) -> (MountConfig field, converter). Table "" is the top level.
_KEYS: dict[tuple[str, str], tuple[str, Callable[[Any], Any]]] = {
    ("", "source"): ("source", _want_source),
    ("", "mountpoint"): ("mountpoint", _want_abs_path),
    ("", "allow_other"): ("allow_other", _want_bool),
    ("", "nonempty"): ("nonempty", _want_bool),
    ("", "uid"): ("uid", _want_id),
    ("", "gid"): ("gid", _want_id),
    ("", "file_mode"): ("file_mode", _want_octal),
    ("", "dir_mode"): ("dir_mode", _want_octal),
    ("", "allow_unsafe_manifests"): ("allow_unsafe_manifests", _want_bool),
    ("", "default_class"): ("default_class", _want_str),
    ("cache", "dir"): ("cache_dir", _want_abs_path),
    ("cache", "size"): ("cache_size", _want_cache_size),
    ("cache", "min_free"): ("min_free", _want_size),
    ("store", "endpoint_url"): ("endpoint_url", _want_endpoint),
    ("store", "engine"): ("store_engine", _want_engine),
    ("store", "part_size"): ("part_size", _want_pos_size),
    ("store", "connect_timeout"): ("connect_timeout", _want_finite_seconds),
    ("store", "read_timeout"): ("read_timeout", _want_finite_seconds),
    ("store", "deadline"): ("deadline", _want_finite_seconds),
    ("store", "max_parallel_gets"): ("max_parallel_gets", _want_pos_int),
    ("store", "max_parallel_puts"): ("max_parallel_puts", _want_pos_int),
    ("store", "max_parallel_uploads"): ("max_parallel_uploads", _want_pos_int),
    ("store", "max_key_length"): ("max_key_bytes", _want_pos_int),
    ("read", "passthrough"): ("passthrough", _want_bool),
    ("read", "readahead"): ("readahead", _want_size),  # every class's, unless set there
    ("read", "readahead_min"): ("readahead_min", _want_pos_size),
    ("read", "max_inflight"): ("max_inflight_bytes", _want_pos_size),
    ("memory", "budget"): ("memory_budget", _want_pos_size),
    ("read", "kernel_read_ahead_kb"): ("kernel_read_ahead_kb", _want_pos_int),
    ("read", "splice"): ("splice", _want_splice),
    ("read", "prefetch_globs"): ("prefetch_globs", _want_globs),
    ("read", "prefetch_min_size"): ("prefetch_min_size", _want_size),
    ("read", "whole_object_max"): ("whole_object_max", _want_size),
    ("shared", "cache"): ("shared_cache", _want_shared_cache),
    ("shared", "endpoint_url"): ("shared_endpoint_url", _want_endpoint),
    ("shared", "profile"): ("shared_profile", _want_str),
    ("shared", "access_key_id"): ("shared_access_key_id", _want_str),
    ("shared", "secret_access_key"): ("shared_secret_access_key", _want_str),
    ("shared", "session_token"): ("shared_session_token", _want_str),
    ("shared", "secret_file"): ("shared_secret_file", _want_abs_path),
    ("shared", "block_size"): ("shared_block_size", _want_pos_size),
    ("shared", "lease"): ("shared_lease", _want_finite_seconds),
    ("shared", "origin_fetches"): ("shared_origin_fetches", _want_pos_int),
    ("shared", "claim_ahead"): ("shared_claim_ahead", _want_bool),
    ("metrics", "addr"): ("metrics_addr", _want_str),
    ("metrics", "allow_remote"): ("metrics_allow_remote", _want_bool),
    ("logging", "level"): ("log_level", _want_level),
}
_TABLES = {t for t, _ in _KEYS if t} | {"classes"}
_CLASS_KEYS: dict[str, Callable[[Any], Any]] = {
    "attr_ttl": _want_seconds,
    "list_ttl": _want_seconds,
    "revalidate_on_open": _want_bool,
    "keep_cache": _want_bool,
    "write_mode": _want_str,
    "readahead_max": _want_size,
    "direct_writes": _want_bool,
    "upload_delay": _want_delay,
    "publish": _want_str,
    "type_small_objects": _want_bool,
    "keep_listings": _want_bool,
    "stream_parts": _want_bool,
}
_TOP_SPECIAL = {"rules", "default_rules"}


def key_line(text: str, path: tuple[str | int, ...]) -> int:
    """Best-effort 1-based line of the key at `path` (('cache', 'size'),
    ('rules', 2, 'class'), ('classes', 'dataset')) in TOML `text`; falls back
    to the line of the enclosing table, then 1."""
    table: list[str] = []
    aot: dict[str, int] = {}
    best = 1

    def split(dotted: str) -> list[str]:
        return [p.strip().strip('"').strip("'") for p in dotted.split(".")]

    want = [str(p) for p in path]
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip() if '"' not in raw else raw.strip()
        if m := re.match(r"^\[\[\s*([^\]]+?)\s*\]\]", line):
            name = ".".join(split(m.group(1)))
            idx = aot.get(name, -1) + 1
            aot[name] = idx
            table = [*split(m.group(1)), str(idx)]
            if want[: len(table)] == table:
                best = no
                if len(want) == len(table):
                    return no
            continue
        if m := re.match(r"^\[\s*([^\]]+?)\s*\]", line):
            table = split(m.group(1))
            if want[: len(table)] == table:
                best = no
                if len(want) == len(table):
                    return no
            continue
        if m := re.match(r"^([A-Za-z0-9_\-\"'. ]+?)\s*=", line):
            full = table + split(m.group(1))
            if full == want:
                return no
            if want[: len(full)] == full:
                best = no  # e.g. an inline table holding the key
    return best


@dataclass
class FileSettings:
    """What a config file sets: MountConfig field -> value (unset keys absent)."""

    path: Path
    values: dict[str, Any]


def load_config_file(path: str | Path) -> FileSettings:
    """Parse and validate a TOML config; every error is 'FILE:LINE: reason'."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigFileError(path, 1, "not UTF-8 text") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"\(at line (\d+), column (\d+)\)", str(exc))
        msg = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(exc))
        line = int(m.group(1)) if m else 1
        col = f" (column {m.group(2)})" if m else ""
        raise ConfigFileError(path, line, f"TOML syntax error: {msg}{col}") from None
    return FileSettings(path, _interpret(doc, text, path))


def _interpret(doc: dict[str, Any], text: str, path: Path) -> dict[str, Any]:
    """The settings of a parsed config. Every problem is found before any is
    reported (ConfigFileErrors), so one `config check` run lists them all."""
    errors: list[ConfigFileError] = []

    def fail(where: tuple[str | int, ...], reason: str) -> None:
        errors.append(ConfigFileError(path, key_line(text, where), reason))

    def convert(where: tuple[str | int, ...], label: str, fn: Callable[[Any], Any], v: Any) -> Any:
        try:
            return fn(v)
        except ConfigError as exc:
            fail(where, f"{label}: {exc}")
            return None

    values: dict[str, Any] = {}
    for key, val in doc.items():
        if key in _TABLES:
            if not isinstance(val, dict):
                fail((key,), f"{key!r} must be a table ([{key}])")
                continue
            if key == "classes":
                continue
            for sub, v in val.items():
                spec = _KEYS.get((key, sub))
                if spec is None:
                    known = ", ".join(sorted(k for t, k in _KEYS if t == key))
                    fail((key, sub), f"unknown key {sub!r} in [{key}] (known: {known})")
                    continue
                got = convert((key, sub), f"{key}.{sub}", spec[1], v)
                if got is not None:
                    values[spec[0]] = got
        elif key in _TOP_SPECIAL:
            continue
        else:
            spec = _KEYS.get(("", key))
            if spec is None:
                known = ", ".join(sorted([k for t, k in _KEYS if not t] + [*_TOP_SPECIAL] + [*_TABLES]))
                fail((key,), f"unknown key {key!r} (known: {known})")
                continue
            got = convert((key,), key, spec[1], val)
            if got is not None:
                values[spec[0]] = got

    # classes: per-class overrides of the built-in contracts; a new name starts
    # from the "default" class.
    classes = dict(DEFAULT_CLASSES)
    class_tables: dict[str, Any] = doc["classes"] if isinstance(doc.get("classes"), dict) else {}
    for name, body in class_tables.items():
        if not isinstance(body, dict):
            fail(("classes", name), f"classes.{name} must be a table ([classes.{name}])")
            continue
        base = classes.get(name) or replace(DEFAULT_CLASSES["default"], name=name)
        changes: dict[str, Any] = {}
        for k, v in body.items():
            conv = _CLASS_KEYS.get(k)
            if conv is None:
                fail(("classes", name, k),
                     f"unknown class setting {k!r} (known: {', '.join(_CLASS_KEYS)})")
                continue
            got = convert(("classes", name, k), f"classes.{name}.{k}", conv, v)
            if got is None:
                continue
            if k == "write_mode" and got not in WRITE_MODES:
                fail(("classes", name, k),
                     f"classes.{name}.write_mode must be one of {', '.join(WRITE_MODES)}")
                continue
            if k == "publish" and got not in PUBLISH_MODES:
                fail(("classes", name, k),
                     f"classes.{name}.publish must be one of {', '.join(PUBLISH_MODES)}")
                continue
            changes[k] = got
        classes[name] = replace(base, **changes)
    if "readahead" in values:
        window = values.pop("readahead")
        own = {n for n, body in class_tables.items() if isinstance(body, dict) and "readahead_max" in body}
        for n, c in classes.items():
            if n not in own:
                classes[n] = replace(c, readahead_max=window)
    if classes != DEFAULT_CLASSES:
        values["classes"] = classes

    # rules: checked in order before the built-in ones (unless default_rules = false)
    keep_defaults = doc.get("default_rules", True)
    if not isinstance(keep_defaults, bool):
        fail(("default_rules",), "default_rules: expected true or false")
        keep_defaults = True
    rules_doc = doc.get("rules", [])
    if not isinstance(rules_doc, list):
        fail(("rules",), "rules must be an array of tables ([[rules]] with glob and class)")
        rules_doc = []
    rules: list[tuple[str, str]] = []
    for i, r in enumerate(rules_doc):
        if not isinstance(r, dict):
            fail(("rules", i), f"rules[{i}] must be a table with glob and class")
            continue
        extra = set(r) - {"glob", "class"}
        if extra:
            fail(("rules", i, sorted(extra)[0]),
                 f"rules[{i}]: unknown key {sorted(extra)[0]!r} (known: glob, class)")
        missing = [k for k in ("glob", "class") if not isinstance(r.get(k), str) or not r[k]]
        for k in missing:
            fail(("rules", i, k) if k in r else ("rules", i),
                 f"rules[{i}] needs a non-empty string {k!r}")
        if extra or missing:
            continue
        if convert(("rules", i, "glob"), f"rules[{i}]", glob_to_regex, r["glob"]) is None:
            continue
        if r["class"] not in classes:
            fail(("rules", i, "class"),
                 f"rules[{i}]: unknown class {r['class']!r} (known: {', '.join(classes)})")
            continue
        rules.append((r["glob"], r["class"]))
    if rules or not keep_defaults:
        values["rules"] = tuple(rules) + (DEFAULT_RULES if keep_defaults else ())
    default_class = values.get("default_class")
    if default_class is not None and default_class not in classes:
        fail(("default_class",), f"default_class: unknown class {default_class!r}")
    if "metrics_addr" in values:
        convert(("metrics", "addr"), "metrics.addr",
                lambda a: parse_listen_addr(a, values.get("metrics_allow_remote", False)),
                values["metrics_addr"])
    if errors:
        raise errors[0] if len(errors) == 1 else ConfigFileErrors(errors)
    return values


def _check_shared(cfg: MountConfig) -> None:
    """The [shared] settings hang together (checked once flags are merged in)."""
    if cfg.shared_cache is None:
        return
    check_shared_cache(cfg.shared_cache)
    if cfg.shared_endpoint_url is not None:
        check_endpoint(cfg.shared_endpoint_url)
    keys = (cfg.shared_access_key_id, cfg.shared_secret_access_key)
    if (keys[0] is None) != (keys[1] is None):
        raise ConfigError("[shared] needs both access_key_id and secret_access_key, or neither")
    if cfg.shared_profile is not None and keys[0] is not None:
        raise ConfigError("[shared] names a profile and keys: use one or the other")
    if cfg.shared_block_size % cfg.chunk_size:
        raise ConfigError(f"[shared] block_size {human_size(cfg.shared_block_size)} must be a "
                          f"multiple of the tier-1 chunk ({human_size(cfg.chunk_size)})")


def build_config(
    file: FileSettings | None, source: str | None, mountpoint: str | Path | None, **flags: Any
) -> MountConfig:
    """Defaults <- config file <- command-line flags (None means 'not given')."""
    values: dict[str, Any] = dict(file.values) if file else {}
    if source is not None:
        values["source"] = source
    if mountpoint is not None:
        values["mountpoint"] = Path(os.path.abspath(mountpoint))
    for k, v in flags.items():
        if v is not None:
            values[k] = v
    for need in ("source", "mountpoint"):
        if need not in values:
            where = f" (not in {file.path} either)" if file else ""
            raise ConfigError(f"missing {need.upper()}{where}")
    if file:
        values["config_file"] = file.path
    known = {f.name for f in fields(MountConfig)}
    cfg = MountConfig(**{k: v for k, v in values.items() if k in known})
    if cfg.endpoint_url is not None:
        check_endpoint(cfg.endpoint_url)
    if cfg.cache_size is not None and cfg.cache_size < MIN_CACHE_SIZE:
        raise ConfigError(f"cache size {human_size(cfg.cache_size)} is below the minimum of "
                          f"{human_size(MIN_CACHE_SIZE)}")
    if cfg.metrics_addr is not None:
        parse_listen_addr(cfg.metrics_addr, cfg.metrics_allow_remote)
    _check_shared(cfg)
    for name in ("file_mode", "dir_mode"):
        if not 0 <= getattr(cfg, name) <= 0o7777:
            raise ConfigError(f"{name} {getattr(cfg, name):o} is not a permission mode (0-7777)")
    for name in ("uid", "gid"):
        if getattr(cfg, name) is not None and not 0 <= getattr(cfg, name) < 0xFFFF_FFFF:
            raise ConfigError(f"{name} {getattr(cfg, name)} is out of range")
    return cfg
