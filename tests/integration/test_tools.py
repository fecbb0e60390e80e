"""Everyday tools on the mount, each compared with the same tool on a local
directory: cp -a, rsync -a, tar cpf/xpf, git, chmod +x && ./script, and a
Hugging Face hub cache (blobs + snapshot symlinks) read back through a remount
and through a second mount. Each must exit 0 and leave attributes equal to the
local copy: type, mode, owner, group, size, mtime, symlink target, bytes.
Run as root (owners are preserved only for root), with the real Debian tools."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from tests.integration.conftest import MountFactory
from tests.support.marks import needs_root
from tests.support.mount import TierfsMount, run_tierfs

pytestmark = [
    needs_root,
    pytest.mark.skipif(not (shutil.which("rsync") and shutil.which("git")),
                       reason="needs rsync and git (make setup installs them)"),
]

T0 = 1_600_000_000_123_456_789  # mtimes set on the source tree (ns)


def sh(*cmd: str | Path, cwd: Path | None = None) -> str:
    res = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, f"{cmd}: exit {res.returncode}: {res.stderr.strip()}"
    return res.stdout


def make_source(root: Path) -> Path:
    """A small tree with the attributes the tools are asked to keep."""
    src = root / "src"
    (src / "bin").mkdir(parents=True)
    (src / "private").mkdir()
    (src / "shared").mkdir()
    (src / "data").mkdir()
    (src / "data/a.txt").write_text("alpha\n")
    (src / "data/big.bin").write_bytes(os.urandom(3 << 20))
    (src / "bin/run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "private/key").write_text("secret\n")
    (src / "shared/notes.md").write_text("# notes\n")
    os.symlink("../data/a.txt", src / "bin/a-link")
    os.symlink("data", src / "data-link")
    os.symlink("nowhere/at/all", src / "dangling")
    os.mkfifo(src / "shared/pipe", 0o620)
    modes = {"bin/run.sh": 0o755, "private/key": 0o600, "data/a.txt": 0o644,
             "data/big.bin": 0o444, "shared/notes.md": 0o664, "bin": 0o755,
             "private": 0o700, "shared": 0o2775, "data": 0o750}
    owners = {"private/key": (1000, 1000), "private": (1000, 1000), "shared": (0, 4242),
              "shared/notes.md": (65534, 4242), "shared/pipe": (65534, 65534),
              "dangling": (1000, 1000)}
    for rel, mode in modes.items():
        os.chmod(src / rel, mode)
    for rel, (uid, gid) in owners.items():
        os.chown(src / rel, uid, gid, follow_symlinks=False)
    for i, p in enumerate(sorted(src.rglob("*"), key=lambda p: -len(p.parts))):
        os.utime(p, ns=(T0 + i * 10**9, T0 + i * 10**9 + 7), follow_symlinks=False)
    return src


def tree(root: Path, *, with_atime: bool = False,
         with_contents: bool = True) -> dict[str, tuple[object, ...]]:
    """Everything a tool is asked to keep, per relative path (`with_contents`: and
    each file's bytes; else what `ls -l` shows)."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = os.lstat(p)
            kind = stat.S_IFMT(st.st_mode)
            if kind == stat.S_IFLNK:
                body: object = os.readlink(p)
            elif kind == stat.S_IFREG and with_contents:
                body = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                body = None
            size = None if kind == stat.S_IFDIR else st.st_size
            times = (st.st_mtime_ns, st.st_atime_ns) if with_atime else (st.st_mtime_ns,)
            out[str(p.relative_to(root))] = (oct(st.st_mode), st.st_uid, st.st_gid, size,
                                             *times, body)
    return out


def assert_same_tree(got: Path, want: Path) -> None:
    g, w = tree(got), tree(want)
    diffs = [f"{k}: mount {g.get(k)} != local {w.get(k)}" for k in sorted(g.keys() | w.keys())
             if g.get(k) != w.get(k)]
    assert diffs == [], "\n".join(diffs)


def test_cp_a(mount_factory: MountFactory, bucket: str, tmp_path: Path) -> None:
    src = make_source(tmp_path)
    m = mount_factory(f"s3://{bucket}", "--allow-other")
    sh("cp", "-a", src, m.mountpoint / "cp")
    sh("cp", "-a", src, tmp_path / "cp")
    assert_same_tree(m.mountpoint / "cp", tmp_path / "cp")
    # and back out again: the mount's attributes are the ones cp reads
    sh("cp", "-a", m.mountpoint / "cp", tmp_path / "back")
    assert_same_tree(tmp_path / "back", tmp_path / "cp")


def test_rsync_a_and_a_second_run_finds_nothing_to_do(
    mount_factory: MountFactory, bucket: str, tmp_path: Path
) -> None:
    src = make_source(tmp_path)
    m = mount_factory(f"s3://{bucket}", "--allow-other")
    sh("rsync", "-a", f"{src}/", f"{m.mountpoint / 'rs'}/")
    sh("rsync", "-a", f"{src}/", f"{tmp_path / 'rs'}/")
    assert_same_tree(m.mountpoint / "rs", tmp_path / "rs")
    # -i lists every file rsync would change: none, if the mount kept everything
    assert sh("rsync", "-ai", "--dry-run", f"{src}/", f"{m.mountpoint / 'rs'}/") == ""


def test_tar_cpf_and_xpf(mount_factory: MountFactory, bucket: str, tmp_path: Path) -> None:
    src = make_source(tmp_path)
    archive = tmp_path / "src.tar"
    sh("tar", "cpf", archive, "-C", src, ".")
    m = mount_factory(f"s3://{bucket}", "--allow-other")
    (m.mountpoint / "x").mkdir()
    (tmp_path / "x").mkdir()
    sh("tar", "xpf", archive, "-C", m.mountpoint / "x")
    sh("tar", "xpf", archive, "-C", tmp_path / "x")
    assert_same_tree(m.mountpoint / "x", tmp_path / "x")
    # an archive made from the mount lists the same entries as one made locally
    # (in another order: readdir's order is each filesystem's own)
    sh("tar", "cpf", m.mountpoint / "again.tar", "-C", m.mountpoint / "x", ".")
    sh("tar", "cpf", tmp_path / "again.tar", "-C", tmp_path / "x", ".")
    listing = ["tar", "--numeric-owner", "--full-time", "-tvf"]
    assert sorted(sh(*listing, m.mountpoint / "again.tar").splitlines()) == \
        sorted(sh(*listing, tmp_path / "again.tar").splitlines())


def test_git_init_add_commit_status_clean(
    mount_factory: MountFactory, bucket: str, tmp_path: Path
) -> None:
    m = mount_factory(f"s3://{bucket}", "--allow-other")
    repo = m.mountpoint / "repo"
    repo.mkdir()
    env = ["-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "init.defaultBranch=main"]
    sh("git", *env, "init", "-q", cwd=repo)
    (repo / "train.py").write_text("print('hi')\n")
    (repo / "run.sh").write_text("#!/bin/sh\nexec python3 train.py\n")
    os.chmod(repo / "run.sh", 0o755)
    os.symlink("train.py", repo / "main.py")
    (repo / "conf").mkdir()
    (repo / "conf/a.yaml").write_text("lr: 0.1\n")
    sh("git", *env, "add", "-A", cwd=repo)
    sh("git", *env, "commit", "-q", "-m", "first", cwd=repo)
    assert sh("git", "status", "--porcelain", cwd=repo) == ""
    files = sh("git", "ls-files", "-s", cwd=repo)
    assert "100755" in next(line for line in files.splitlines() if line.endswith("run.sh"))
    assert "120000" in next(line for line in files.splitlines() if line.endswith("main.py"))
    (repo / "train.py").write_text("print('bye')\n")
    assert sh("git", "status", "--porcelain", cwd=repo) == " M train.py\n"
    sh("git", *env, "commit", "-qam", "second", cwd=repo)
    assert sh("git", "status", "--porcelain", cwd=repo) == ""
    sh("git", "fsck", "--strict", cwd=repo)
    m.umount()
    m = mount_factory(f"s3://{bucket}", "--allow-other", mountpoint=m.mountpoint)
    assert sh("git", "status", "--porcelain", cwd=repo) == ""
    assert sh("git", "log", "--format=%s", cwd=repo) == "second\nfirst\n"


def test_chmod_x_and_run(open_dir: Path, mount_factory: MountFactory, bucket: str) -> None:
    m = mount_factory(f"s3://{bucket}", "--allow-other", mountpoint=open_dir / "mnt")
    script = m.mountpoint / "run.sh"
    script.write_text("#!/bin/sh\necho \"ran as $(id -u)\"\n")
    with pytest.raises(PermissionError):  # 0644: not executable yet
        subprocess.run([str(script)], capture_output=True, text=True, timeout=30)
    sh("chmod", "+x", script)
    assert sh(script) == "ran as 0\n"
    assert sh("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", script) == \
        "ran as 65534\n"


def hub_tree(root: Path) -> dict[str, bytes]:
    """A Hugging Face hub cache: models--org--name/{blobs,refs,snapshots/<rev>}."""
    repo = root / "hub" / "models--org--tiny"
    rev = "0123456789abcdef0123456789abcdef01234567"
    files = {"config.json": b'{"hidden_size": 8}\n', "model.safetensors": os.urandom(2 << 20),
             "tokenizer/vocab.txt": b"a\nb\nc\n"}
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs/main").write_text(rev)
    for name, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / sha).write_bytes(data)
        link = repo / "snapshots" / rev / name
        link.parent.mkdir(parents=True, exist_ok=True)
        depth = len(Path(name).parts) + 1
        os.symlink("../" * depth + f"blobs/{sha}", link)
    return {f"hub/models--org--tiny/snapshots/{rev}/{n}": d for n, d in files.items()}


def read_hub(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        p = root / rel
        assert p.is_symlink(), rel
        assert os.readlink(p).startswith("../") and "blobs/" in os.readlink(p)
        assert p.read_bytes() == data, rel
        assert p.resolve().parent.name == "blobs"
    ref = root / "hub/models--org--tiny/refs/main"
    assert (root / "hub/models--org--tiny/snapshots" / ref.read_text()).is_dir()


def flush(m: TierfsMount) -> None:
    res = run_tierfs("flush", str(m.mountpoint), env=m.env, timeout=300)
    assert res.returncode == 0, res.stderr


def test_hugging_face_hub_cache_through_a_remount_and_a_second_mount(
    mount_factory: MountFactory, bucket: str, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    m = mount_factory(f"s3://{bucket}", cache_dir=cache)
    files = hub_tree(m.mountpoint)
    read_hub(m.mountpoint, files)
    flush(m)
    m.umount()
    m = mount_factory(f"s3://{bucket}", cache_dir=cache, mountpoint=m.mountpoint)
    read_hub(m.mountpoint, files)
    other = mount_factory(f"s3://{bucket}")  # another node: nothing cached
    read_hub(other.mountpoint, files)
    for root in (m.mountpoint, other.mountpoint):
        links = [p for p in (root / "hub").rglob("*") if p.is_symlink()]
        assert len(links) == len(files)
        assert all(stat.S_IMODE(p.lstat().st_mode) == 0o777 for p in links)


def make_node_tree(root: Path) -> Path:
    """The tree of issue 36: scripts, a 0600 key, files of uid 65534, a sticky 1777
    directory, Hugging Face snapshot symlinks into blobs/, whole-second mtimes."""
    src = root / "node-src"
    for d in ("scripts", "keys", "nobody", "shared", "hub/blobs", "hub/snapshots/abc123/tok"):
        (src / d).mkdir(parents=True)
    (src / "scripts/run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "scripts/env.sh").write_text("export X=1\n")
    (src / "keys/id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    for i in range(3):
        (src / f"nobody/n{i}.txt").write_text(f"{i}\n" * (i + 1))
    (src / "shared/notes.md").write_text("# shared\n")
    blobs = {"config.json": b'{"a": 1}\n', "tok/vocab.txt": b"a\nb\n", "w.bin": os.urandom(70_000)}
    for name, data in blobs.items():
        sha = hashlib.sha256(data).hexdigest()
        (src / "hub/blobs" / sha).write_bytes(data)
        depth = len(Path(name).parts) + 1
        os.symlink("../" * depth + f"blobs/{sha}", src / "hub/snapshots/abc123" / name)
    os.mkfifo(src / "shared/fifo", 0o600)
    modes = {"scripts/run.sh": 0o755, "scripts/env.sh": 0o644, "keys/id_ed25519": 0o600,
             "keys": 0o700, "shared": 0o1777, "nobody": 0o755, "shared/notes.md": 0o664}
    for rel, mode in modes.items():
        os.chmod(src / rel, mode)
    for p in [*(src / "nobody").iterdir(), src / "nobody"]:
        os.chown(p, 65534, 65534)
    os.chown(src / "shared/notes.md", 1000, 1000)
    for i, p in enumerate(sorted(src.rglob("*"), key=lambda p: -len(p.parts))):
        t = 1_700_000_000 + 7 * i  # whole seconds
        os.utime(p, (t, t), follow_symlinks=False)
    return src


def transfer(tool: str, src: Path, dst: Path, tmp: Path) -> None:
    if tool == "cp":
        sh("cp", "-a", src, dst)
    elif tool == "rsync":
        sh("rsync", "-a", f"{src}/", f"{dst}/")
    else:
        archive = tmp / "node-src.tar"
        if not archive.exists():
            sh("tar", "cpf", archive, "-C", src, ".")
        dst.mkdir()
        sh("tar", "xpf", archive, "-C", dst)


@pytest.mark.parametrize("tool", ["cp", "rsync", "tar"])
def test_what_a_tool_preserved_survives_a_new_node(
    tool: str, mount_factory: MountFactory, bucket: str, tmp_path: Path
) -> None:
    """After a remount on an empty cache dir (a new node), every entry's type, mode,
    owner, mtime, symlink target and bytes equal the local copy's, read from
    listings and the directories' attribute objects; `rsync -a` of the same
    source again from that node transfers nothing."""
    src = make_node_tree(tmp_path)
    m = mount_factory(f"s3://{bucket}", "--allow-other")
    transfer(tool, src, m.mountpoint / "dst", tmp_path)
    transfer(tool, src, tmp_path / "dst", tmp_path)
    m.umount()
    fresh = mount_factory(f"s3://{bucket}", "--allow-other", cache_dir=tmp_path / "empty-cache")
    # before any read (config.json, a manifest-class name, is HEADed at each lookup)
    assert tree(fresh.mountpoint / "dst", with_contents=False) == \
        tree(tmp_path / "dst", with_contents=False)
    # no file read: one GET per directory (its attribute object), the mount's root's too
    dirs = sum(1 for p in (tmp_path / "dst").rglob("*") if p.is_dir() and not p.is_symlink())
    assert fresh.status()["store"]["requests"]["get"]["ok"] == dirs + 2
    assert_same_tree(fresh.mountpoint / "dst", tmp_path / "dst")  # and the bytes
    stats = sh("rsync", "-a", "--stats", f"{src}/", f"{fresh.mountpoint / 'dst'}/")
    assert "Number of regular files transferred: 0" in stats, stats
