"""Security properties of a mount: file modes, hashed cache names, mount options,
no credentials anywhere they could leak, hostile object keys."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import socket
import stat
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import trio

from tests.integration.conftest import MountFactory
from tests.support.mount import TierfsMount, kill_daemon_with_open_writer, run_tierfs
from tests.support.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedServer
from tierfs.cache import Cache
from tierfs.config import DEFAULT_CLASSES, DEFAULT_RULES
from tierfs.control import socket_path
from tierfs.health import StoreHealth
from tierfs.kept_listings import KeptListings
from tierfs.namespace import Namespace
from tierfs.policy import Policy
from tierfs.posix import Defaults
from tierfs.store.base import Listing, ObjectInfo
from tierfs.store.s3client import safe_endpoint
from tierfs.workers import Workers
from tierfs.writeback.journal import Journal

MiB = 1 << 20
ODD_KEYS = ["dir/evil name;$(id)`x`.bin", "dir/ünï cødé.bin", "dir/a\nb.bin", "dir/tab\tc.bin"]


def mount_options(mountpoint: Path) -> set[str]:
    target = os.path.realpath(mountpoint)
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if parts[1] == target:
                return set(parts[3].split(","))
    raise AssertionError(f"{mountpoint} not mounted")


def as_nobody(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd],
                          capture_output=True, text=True, timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cache_modes_socket_and_hashed_names(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    client = s3_server.client()
    for key in ODD_KEYS:
        client.put_object(Bucket=bucket, Key=key, Body=key.encode() * 1000)
    cache = tmp_path / "cache-sec"
    m = mount_factory(f"s3://{bucket}", cache_dir=cache)
    mp = m.mountpoint
    # keys with spaces, shell metacharacters, UTF-8, newline and tab bytes are served
    assert sorted(os.listdir(mp / "dir")) == sorted(k.split("/", 1)[1] for k in ODD_KEYS)
    for key in ODD_KEYS:
        assert (mp / key).read_bytes() == key.encode() * 1000
    (mp / "ck").mkdir()
    (mp / "ck/model.pt").write_bytes(os.urandom(3 * MiB))
    # a writer killed before close leaves a quarantined file: it is private too
    kill_daemon_with_open_writer(m, mp / "ck/half.pt", 4096)
    m = mount_factory(f"s3://{bucket}", cache_dir=cache, mountpoint=mp)
    assert (mp / "dir/a\nb.bin").read_bytes()[:3] == b"dir"
    assert list((cache / "quarantine").iterdir())
    # control socket: 0600, a socket
    sock = socket_path(cache)
    st = os.lstat(sock)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    # every directory of the cache is 0700 and every file 0600 (no group/other bits)
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    loose = []
    for dirpath, dirnames, filenames in os.walk(cache):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            mode = stat.S_IMODE(os.lstat(p).st_mode)
            if mode & 0o077:
                loose.append(f"{p.relative_to(cache)} {oct(mode)}")
    assert not loose, loose
    # object keys never become file names: objects/ holds hex hashes only, and no
    # name anywhere in the cache dir carries a key's segment
    names = os.listdir(cache / "objects")
    assert len(names) >= len(ODD_KEYS) and all(re.fullmatch(r"[0-9a-f]{16,64}", n) for n in names), names
    everything = [n for _, ds, fs in os.walk(cache) for n in ds + fs]
    for key in [*ODD_KEYS, "ck/model.pt"]:
        seg = key.rsplit("/", 1)[1]
        assert not [n for n in everything if seg in n], seg


def test_mount_options_allow_other_off_default_permissions_on(
    open_dir: Path, mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer
) -> None:
    s3_server.client().put_object(Bucket=bucket, Key="f.txt", Body=b"data")
    m = mount_factory(f"s3://{bucket}", mountpoint=open_dir / "mnt")
    opts = mount_options(m.mountpoint)
    assert "default_permissions" in opts and "allow_other" not in opts, opts
    denied = as_nobody("cat", str(m.mountpoint / "f.txt"))
    assert denied.returncode != 0 and "Permission denied" in denied.stderr
    m.umount()
    m2 = mount_factory(f"s3://{bucket}", "--allow-other", mountpoint=m.mountpoint)
    opts = mount_options(m2.mountpoint)
    assert "allow_other" in opts and "default_permissions" in opts, opts
    # another user may read (mode 0644) but, with default_permissions, not write
    ok = as_nobody("cat", str(m2.mountpoint / "f.txt"))
    assert ok.returncode == 0 and ok.stdout == "data", ok.stderr
    no = as_nobody("sh", "-c", f"echo x > {m2.mountpoint / 'f.txt'}")
    assert no.returncode != 0 and "Permission denied" in no.stderr
    no = as_nobody("touch", str(m2.mountpoint / "new.txt"))
    assert no.returncode != 0 and "Permission denied" in no.stderr


def test_credentials_never_in_logs_status_metrics_or_errors(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    s3_server.client().put_object(Bucket=bucket, Key="f.bin", Body=os.urandom(MiB))
    port = free_port()
    cache = tmp_path / "cache-cred"
    m = mount_factory(f"s3://{bucket}", "--log-level", "debug", "--metrics-addr",
                      f"127.0.0.1:{port}", cache_dir=cache)
    mp = m.mountpoint
    assert len((mp / "f.bin").read_bytes()) == MiB
    (mp / "w.txt").write_bytes(b"x")
    with pytest.raises(OSError):
        (mp / "missing.bin").read_bytes()
    status = run_tierfs("status", str(mp), "--json", env=m.env, check=True).stdout
    status += run_tierfs("status", str(mp), env=m.env, check=True).stdout
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    # a mount refused for bad credentials: the error names the problem, not the secret
    bad_secret = "wr0ng-s3cret-value-" + hashlib.sha256(b"x").hexdigest()[:8]
    bad = TierfsMount(f"s3://{bucket}", tmp_path / "mnt-bad", tmp_path / "cache-bad",
                      {**m.env, "AWS_SECRET_ACCESS_KEY": bad_secret})
    with pytest.raises(RuntimeError) as refused:
        bad.start()
    bad.cleanup()
    assert "denied" in str(refused.value).lower() or "credential" in str(refused.value).lower()
    m.umount()
    logs = "".join(p.read_text(errors="replace") for p in [*cache.glob("*.log"),
                                                         *(tmp_path / "cache-bad").glob("*.log")])
    assert "level=debug" in logs  # debug logging really was on
    for where, text in (("log", logs), ("status", status), ("metrics", metrics),
                        ("mount error", str(refused.value))):
        for secret in (SECRET_KEY, bad_secret):
            assert secret not in text, f"secret in {where}"
        assert f"Credential={ACCESS_KEY}" not in text and "Signature=" not in text, where
    # an endpoint with userinfo is shown without it
    assert "hunter2" not in safe_endpoint("http://user:hunter2@127.0.0.1:9000/")


def test_hostile_keys_in_a_listing_are_skipped_or_served_safely(tmp_path: Path) -> None:
    """A mock Listing is needed: SeaweedFS refuses keys with '..' segments (400
    InvalidRequest), yet another S3 server (or a bucket filled by other tools)
    can list them, so the namespace must cope with a listing a real server here
    cannot produce."""
    cache = Cache(tmp_path / "c", capacity=64 * MiB, min_free=0)
    cache.bind("test|hostile")
    try:
        ns = Namespace(store=None, cache=cache, policy=Policy(DEFAULT_RULES, DEFAULT_CLASSES, "default"),  # type: ignore[arg-type]
                       workers=Workers(data=1, upload=1, meta=1, disk=1),
                       health=StoreHealth(probe_every=5.0), overlay=Journal(),
                       kept=KeptListings(cache, Workers(data=1, upload=1, meta=1, disk=1)),
                       on_changed=lambda inode: None, on_gone=lambda parent, name: None,
                       defaults=Defaults(uid=0, gid=0))
        root = ns.get(1)

        def info(key: str) -> ObjectInfo:
            # past posix.SYMLINK_MAX: a lookup never HEADs it (there is no store here)
            return ObjectInfo(key, 1 << 20, "e" * 32, time.time())

        listing = Listing(
            files=[info("../../etc/passwd"), info(".."), info("."), info(""), info("a\nb"),
                   info("x" * 256), info("nul\0byte"), info("ok.txt"), info("sub")],
            dirs=["..", ".", "", "sub", "d\nir", "../../etc"],
        )
        ns.listings.install(root, listing)
        assert root.children is not None
        assert sorted(root.children) == ["a\nb", "d\nir", "ok.txt", "sub"]
        assert ns.get(root.children["sub"]).is_dir  # object and prefix: the directory wins

        async def lookups() -> None:
            for name, code in (("..", errno.ENOENT), ("../../etc/passwd", errno.ENOENT),
                               ("x" * 256, errno.ENAMETOOLONG), ("nul\0byte", errno.ENOENT)):
                with pytest.raises(OSError) as exc:
                    await ns.lookup(1, name)
                assert exc.value.errno == code
            assert (await ns.lookup(1, "a\nb")).path == "a\nb"

        trio.run(lookups)
        # the cache never turns a key into a path: it stays inside objects/
        passwd = Path("/etc/passwd").read_bytes()
        for key in ("../../etc/passwd", "/etc/passwd", "a\nb", "..", "x" * 4000):
            entry = cache.open(key, "e" * 32, 3, time.time())
            try:
                assert entry.path.parent == cache.objects_dir
                assert re.fullmatch(r"[0-9a-f]+", entry.path.name)
            finally:
                cache.release(entry)
        assert Path("/etc/passwd").read_bytes() == passwd
    finally:
        cache.close()
