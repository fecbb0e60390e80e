"""The control socket and the daemon's process life: bad requests get an answer
(or a closed connection) and never take the daemon down; SIGINT unmounts
cleanly and loses nothing acknowledged. Real mounts, real SeaweedFS."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.integration.conftest import MountFactory
from tests.support.mount import TIERFS, TierfsMount, is_mounted, run_tierfs
from tests.support.seaweed import SeaweedServer
from tierfs.control import MAX_REQUEST, find_socket


def exchange(sock_path: str, raw: bytes) -> dict | None:
    """Send raw bytes, read one reply line; None if the daemon closed without one."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(sock_path)
        try:
            s.sendall(raw)
        except BrokenPipeError:  # it hung up first (an oversized request)
            return None
        s.shutdown(socket.SHUT_WR)
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
    return json.loads(buf.split(b"\n", 1)[0]) if buf else None


def test_bad_control_requests_are_refused_and_the_daemon_lives(
    mount_factory: MountFactory, bucket: str
) -> None:
    m = mount_factory(f"s3://{bucket}")
    sock = find_socket(m.mountpoint)
    for raw, says in (
        (b"not json\n", "bad request"),
        (b"\xff\xfe\n", "bad request"),
        (b"[1, 2]\n", "bad request"),
        (b'{"no": "op"}\n', "bad request"),
        (b'{"op": "no-such-op"}\n', "bad request"),
        (b'{"op": ["status"]}\n', "bad request"),
        (b'{"op": "flush", "prefix": 5}\n', "must be a string"),
        (b'{"op": "pending", "prefix": "../../etc"}\n', "'..'"),
        (b'{"op": "cache_evict", "path": "../x"}\n', "'..'"),
        (b'{"op": "warmup", "paths": "not-a-list"}\n', "list of paths"),
        (b'{"op": "policy", "path": null}\n', "must be a string"),
    ):
        reply = exchange(sock, raw)
        assert reply is not None and reply["ok"] is False, (raw, reply)
        assert says in reply["error"], (raw, reply)
    # no newline and too long: dropped without an answer; half a line, then gone
    assert exchange(sock, b"x" * (MAX_REQUEST + 2)) is None
    assert exchange(sock, b'{"op": "sta') is None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(sock)  # and straight away closed
    assert m.status()["pid"] == m.pid
    assert exchange(sock, b'{"op": "status"}\n')["ok"] is True
    log = (m.cache_dir / "tierfs.log").read_text()
    assert "Traceback" not in log and "level=error" not in log, log


def test_sigint_unmounts_cleanly_and_keeps_what_was_acknowledged(
    bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    mp, cache = tmp_path / "mnt", tmp_path / "cache"
    mp.mkdir()
    env = {**os.environ, **s3_server.env()}
    daemon = subprocess.Popen([*TIERFS, "mount", f"s3://{bucket}", str(mp), "--foreground",
                               "--cache-dir", str(cache)], env=env, stderr=subprocess.PIPE,
                              text=True)
    m = TierfsMount(f"s3://{bucket}", mp, cache, env)
    try:
        deadline = time.monotonic() + 30
        while not (is_mounted(mp) and os.stat(mp).st_ino == 1):
            # hang guard
            assert time.monotonic() < deadline and daemon.poll() is None, "never mounted"
            time.sleep(0.05)
        payload = os.urandom(8 << 20)
        (mp / "ckpt").mkdir()
        (mp / "ckpt/model.pt").write_bytes(payload)  # write-back: acknowledged at close
        daemon.send_signal(signal.SIGINT)
        _, err = daemon.communicate(timeout=60)
        assert daemon.returncode == 0, err
        assert "signal received" in err and "Traceback" not in err
        assert not is_mounted(mp)
        assert not any(mp.iterdir())
        m.start()  # what was not uploaded yet resumes from the journal
        res = run_tierfs("flush", str(mp), env=env, timeout=60)
        assert res.returncode == 0, res.stderr
        body = s3_server.client().get_object(Bucket=bucket, Key="ckpt/model.pt")["Body"]
        assert body.read() == payload
    finally:
        if daemon.poll() is None:
            daemon.kill()
        m.cleanup()
