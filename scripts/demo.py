"""`make demo`: tierfs's main job on the embedded default, start to finish.

Starts a local SeaweedFS S3 server on a free loopback port, uploads sample
data (a dataset shard, a model-like file, a small tree), mounts the bucket
with tierfs, reads and verifies every byte, reads again to show tier 1
serving it, writes a checkpoint and its manifest through the mount and checks
them in the bucket, unmounts and stops the server.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.seaweed import SeaweedServer  # noqa: E402

MiB = 1 << 20
TIERFS = [sys.executable, "-m", "tierfs"]


def step(msg: str) -> None:
    print(f"\n== {msg}", flush=True)


def sample_data() -> dict[str, bytes]:
    rng = __import__("random").Random(42)
    files = {
        "datasets/shards/shard-000000.tar": rng.randbytes(96 * MiB),
        "datasets/shards/shard-000001.tar": rng.randbytes(32 * MiB),
        "models/tiny/model.safetensors": rng.randbytes(80 * MiB),
        "models/tiny/config.json": json.dumps({"hidden": 64, "layers": 2}).encode(),
    }
    for i in range(20):
        files[f"datasets/captions/{i:04d}.txt"] = f"caption {i}\n".encode() * (i + 1)
    return files


def read_all(mount: Path, files: dict[str, bytes]) -> float:
    started = time.perf_counter()
    for key, data in files.items():
        h = hashlib.sha256()
        with open(mount / key, "rb", buffering=0) as f:
            while chunk := f.read(4 * MiB):
                h.update(chunk)
        if h.hexdigest() != hashlib.sha256(data).hexdigest():
            raise SystemExit(f"MISMATCH: {key}")
    return time.perf_counter() - started


def store_bytes(mount: Path) -> float:
    out = subprocess.run([*TIERFS, "status", str(mount), "--json"], capture_output=True,
                         text=True, check=True)
    metrics = json.loads(out.stdout)["metrics"]
    return metrics.get("tierfs_store_bytes_total{op=get}", 0.0)


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="tierfs-demo-"))
    mount, cache = work / "mnt", work / "cache"
    mount.mkdir()
    step("starting a local SeaweedFS S3 server")
    with SeaweedServer(data_dir=work / "seaweed") as srv:
        env = {**os.environ, **srv.env()}
        print(f"   endpoint {srv.endpoint}")
        files = sample_data()
        total = sum(len(v) for v in files.values())
        step(f"uploading {len(files)} objects ({total / MiB:.0f} MiB) to s3://demo")
        client = srv.client()
        srv.make_bucket("demo")
        for key, data in files.items():
            client.put_object(Bucket="demo", Key=key, Body=data)
        step(f"tierfs mount s3://demo {mount} --cache-dir {cache}")
        subprocess.run([*TIERFS, "mount", "s3://demo", str(mount), "--cache-dir", str(cache),
                        "--cache-size", "2G"], env=env, check=True)
        try:
            subprocess.run(["ls", "-l", str(mount), str(mount / "datasets/shards"),
                            str(mount / "models/tiny")], check=True)
            step("first read: every byte from the store, verified by sha256")
            cold = read_all(mount, files)
            fetched = store_bytes(mount)
            print(f"   {total / MiB:.0f} MiB in {cold:.2f}s ({total / MiB / cold:.0f} MiB/s), "
                  f"{fetched / MiB:.0f} MiB fetched from the store")
            step("second read (page cache dropped where allowed): served from tier 1")
            subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"],
                           stderr=subprocess.DEVNULL, check=False)
            warm = read_all(mount, files)
            again = store_bytes(mount) - fetched
            print(f"   {total / MiB:.0f} MiB in {warm:.2f}s ({total / MiB / warm:.0f} MiB/s), "
                  f"{again / MiB:.0f} MiB fetched from the store")
            if again:
                raise SystemExit("expected the second read to come from tier 1")
            step("write-back checkpoint: close returns once on local NVMe, upload follows")
            ckpt = os.urandom(64 * MiB)
            (mount / "checkpoints/step-100").mkdir(parents=True)
            started = time.perf_counter()
            with open(mount / "checkpoints/step-100/model.pt", "wb") as f:
                f.write(ckpt)
            closed = time.perf_counter() - started
            manifest = json.dumps({"model.pt": hashlib.sha256(ckpt).hexdigest()})
            (mount / "checkpoints/step-100/.metadata.tmp").write_text(manifest)
            os.replace(mount / "checkpoints/step-100/.metadata.tmp",
                       mount / "checkpoints/step-100/.metadata")
            published = time.perf_counter() - started
            print(f"   64 MiB closed in {closed:.2f}s; .metadata published (after the "
                  f"checkpoint landed: manifest barrier) at {published:.2f}s")
            subprocess.run([*TIERFS, "flush", str(mount)], check=True)
            got = client.get_object(Bucket="demo", Key="checkpoints/step-100/model.pt")["Body"].read()
            if hashlib.sha256(got).digest() != hashlib.sha256(ckpt).digest():
                raise SystemExit("MISMATCH: checkpoint in the bucket")
            print("   checkpoint in the bucket, byte-identical (checked with boto3)")
            subprocess.run([*TIERFS, "status", str(mount)], check=True)
        finally:
            step(f"tierfs umount {mount}")
            subprocess.run([*TIERFS, "umount", str(mount)], check=False)
        step("stopping the S3 server")
    print("\ndemo OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
