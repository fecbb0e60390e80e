"""Opening the shared tier before the mount: its store, credentials, secret and probe.

Misconfiguration (no such bucket, refused credentials, an unreadable secret)
stops the mount with one line; a shared tier that is merely unreachable does
not (it is a cache: the origin serves meanwhile, and the tier is asked again).
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass

import boto3

from tierfs.config import MountConfig
from tierfs.errors import ConfigError
from tierfs.store import open_store, parse_source
from tierfs.store.base import UNREACHABLE_KINDS, RequestObserver, Store, StoreError

log = logging.getLogger(__name__)

MIN_SECRET = 16  # bytes


@dataclass
class SharedStore:
    """What the mount needs to build the SharedTier (tier.py) once it runs."""

    store: Store
    conditional: bool  # single-flight across nodes; False: every node fetches for itself
    secret: bytes | None
    warnings: list[str]


def origin_of(source: str) -> dict[str, str]:
    """SharedTier's `source` and `prefix` for a mount SOURCE: the bucket (or root),
    and the prefix that makes the mount's keys full keys."""
    scheme, where, prefix = parse_source(source)
    return {"source": f"{scheme}://{where}", "prefix": prefix}


def session_for(cfg: MountConfig) -> boto3.session.Session:
    """The shared tier's credentials: its own profile or keys, else the standard chain."""
    if cfg.shared_profile is not None:
        return boto3.session.Session(profile_name=cfg.shared_profile)
    if cfg.shared_access_key_id is not None:
        return boto3.session.Session(
            aws_access_key_id=cfg.shared_access_key_id,
            aws_secret_access_key=cfg.shared_secret_access_key,
            aws_session_token=cfg.shared_session_token)
    return boto3.session.Session()


def read_secret(path: os.PathLike[str] | str) -> bytes:
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            secret = f.read().strip()
    except OSError as exc:
        raise ConfigError(f"[shared] secret_file {path}: {exc.strerror}") from None
    if len(secret) < MIN_SECRET:
        raise ConfigError(f"[shared] secret_file {path}: the secret must be at least "
                          f"{MIN_SECRET} bytes")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("[shared] secret_file %s can be read by others than its owner", path)
    return secret


def open_shared(cfg: MountConfig, observer: RequestObserver, max_connections: int) -> SharedStore:
    """The shared tier's store, checked and probed. Raises ConfigError or
    StoreError (one line) for what only the user can fix."""
    assert cfg.shared_cache is not None
    secret = None if cfg.shared_secret_file is None else read_secret(cfg.shared_secret_file)
    try:
        session = session_for(cfg)
    except Exception as exc:  # botocore's ProfileNotFound and kin
        raise ConfigError(f"[shared] credentials: {exc}") from None
    store = open_store(
        cfg.shared_cache, endpoint_url=cfg.shared_endpoint_url, part_size=cfg.shared_block_size,
        max_connections=max_connections, connect_timeout=cfg.connect_timeout,
        read_timeout=cfg.read_timeout, deadline=cfg.deadline, observer=observer, session=session,
        engine=cfg.store_engine)
    warnings: list[str] = []
    try:
        store.check()
        conditional = store.probe_conditional_put()
    except StoreError as exc:
        if exc.kind not in UNREACHABLE_KINDS:
            raise StoreError(f"shared cache {store.url}: {exc}", errno_=exc.errno,
                             kind=exc.kind) from None
        warnings.append(f"shared cache {store.url} unreachable ({exc}): reading from the "
                        "origin until it answers")
        # Unknown until it answers: claims are tried. Where the store ignores the
        # condition every node's claim "wins" and each fetches for itself, as
        # without claims: more origin bytes, never a wrong one.
        conditional = True
    else:
        if not conditional:
            warnings.append(f"shared cache {store.url} does not enforce conditional writes: "
                            "every node fetches each block from the origin itself (no "
                            "single-flight across nodes)")
    if secret is None:
        log.info("shared cache %s: blocks verified by xxh3-128 (integrity only; a "
                 "[shared] secret_file also authenticates them)", store.url)
    for w in warnings:
        log.warning("%s", w)
    return SharedStore(store, conditional, secret, warnings)
