"""What a new user meets first (issue 15 §7): a mistake gets one clear line and a
non-zero exit, help says what things are, and nothing is done silently.
Real mounts, real SeaweedFS, the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.integration.conftest import MountFactory
from tests.support.mount import TIERFS, is_mounted, run_tierfs
from tests.support.seaweed import SeaweedServer
from tierfs.cli import _alive


def one_line_error(res: subprocess.CompletedProcess[str]) -> str:
    err = res.stderr.strip()
    assert res.returncode != 0, res
    assert "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("tierfs: error: "), err
    return err


def env_of(s3: SeaweedServer, **extra: str) -> dict[str, str]:
    return {**os.environ, **s3.env(), **extra}


def test_non_empty_mountpoint_refused_unless_nonempty(
    mount_factory: MountFactory, bucket: str, tmp_path: Path, s3_server: SeaweedServer
) -> None:
    mp = tmp_path / "full"
    mp.mkdir()
    (mp / "hidden.txt").write_text("would be hidden by the mount")
    refused = mount_factory(f"s3://{bucket}", mountpoint=mp, start=False)  # torn down if made
    res = run_tierfs("mount", f"s3://{bucket}", str(mp), "--cache-dir", str(refused.cache_dir),
                     env=env_of(s3_server))
    err = one_line_error(res)
    assert "not empty" in err and "--nonempty" in err
    assert not is_mounted(mp)
    m = mount_factory(f"s3://{bucket}", "--nonempty", mountpoint=mp)
    assert is_mounted(mp) and not (mp / "hidden.txt").exists()
    m.umount()
    assert (mp / "hidden.txt").read_text() == "would be hidden by the mount"


def test_umount_of_a_busy_mount_says_busy_unless_lazy(
    mount_factory: MountFactory, bucket: str
) -> None:
    m = mount_factory(f"s3://{bucket}")
    (m.mountpoint / "d").mkdir()
    inside = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                              cwd=m.mountpoint / "d", stdin=subprocess.PIPE)
    try:
        res = run_tierfs("umount", str(m.mountpoint), env=m.env)
        err = one_line_error(res)
        assert "busy" in err and "--lazy" in err
        assert is_mounted(m.mountpoint)
        assert m.status()["pid"] == m.pid  # still serving
        assert sorted(os.listdir(m.mountpoint)) == ["d"]
        res = run_tierfs("umount", "--lazy", str(m.mountpoint), env=m.env)
        assert res.returncode == 0, res.stderr
        assert not is_mounted(m.mountpoint)
    finally:
        inside.communicate(b"", timeout=30)


def test_umount_with_nothing_pending_is_quick(mount_factory: MountFactory, bucket: str) -> None:
    """Was 2-3 s: the CLI imported the daemon's modules (boto3, pyfuse3) and then
    polled for a daemon that had already exited (an unreaped process still answers
    kill(pid, 0)). Now: the umount imports none of them, and a zombie counts as gone."""
    m = mount_factory(f"s3://{bucket}")
    os.listdir(m.mountpoint)
    res = subprocess.run([sys.executable, "-X", "importtime", *TIERFS[1:], "umount",
                          str(m.mountpoint)], env=m.env, capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    assert not is_mounted(m.mountpoint)
    imported = {line.rpartition("|")[2].strip().split(".")[0]
                for line in res.stderr.splitlines() if line.startswith("import time:")}
    assert "tierfs" in imported  # the listing is what it looks like
    assert not imported & {"boto3", "botocore", "pyfuse3", "lmdb", "awscrt"}, imported
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
    try:
        assert not _alive(zombie.pid)
    finally:
        zombie.wait()
    assert _alive(os.getpid())


def test_endpoint_without_scheme_is_one_clear_line_and_logged(
    bucket: str, tmp_path: Path, s3_server: SeaweedServer
) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    host = s3_server.endpoint.removeprefix("http://")
    res = run_tierfs("mount", f"s3://{bucket}", str(mp), "--cache-dir", str(tmp_path / "c1"),
                     "--endpoint-url", host, env=env_of(s3_server))
    err = one_line_error(res)
    assert f"http://{host}" in err  # says what to write instead
    # The same in the environment reaches the daemon: its failure is in its log too.
    res = run_tierfs("mount", f"s3://{bucket}", str(mp), "--cache-dir", str(tmp_path / "c2"),
                     env=env_of(s3_server, AWS_ENDPOINT_URL=host))
    err = one_line_error(res)
    assert host in err and "http://" in err and "exited during start-up" not in err
    log = (tmp_path / "c2" / "tierfs.log").read_text()
    assert host in log and "level=error" in log
    assert not is_mounted(mp)


def test_cache_ls_into_a_closed_pipe_is_quiet(mount_factory: MountFactory, bucket: str) -> None:
    m = mount_factory(f"s3://{bucket}")
    for i in range(3):
        (m.mountpoint / f"f{i}.bin").write_bytes(b"x" * 1000)
    # `tierfs cache ls MNT | head -0`: the reader is gone before the first line.
    r, w = os.pipe()
    os.close(r)
    proc = subprocess.run([*TIERFS, "cache", "ls", str(m.mountpoint)], stdout=w,
                          stderr=subprocess.PIPE, text=True, env=m.env, timeout=60)
    os.close(w)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.stderr == ""
    assert proc.returncode in (0, 141)


def test_harmless_mistakes_are_one_line_not_tracebacks_in_the_log(
    mount_factory: MountFactory, bucket: str
) -> None:
    m = mount_factory(f"s3://{bucket}")
    res = run_tierfs("cache", "evict", str(m.mountpoint / "no-such-file"), env=m.env)
    one_line_error(res)
    res = run_tierfs("warmup", str(m.mountpoint / "no-such-file"), env=m.env)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    log = (m.cache_dir / "tierfs.log").read_text()
    assert "Traceback" not in log and "exc=" not in log, log
    assert "level=error" not in log, log


def test_help_and_version(tmp_path: Path) -> None:
    top = run_tierfs("--help")
    assert top.returncode == 0
    assert "Command line only" not in top.stdout  # was the module's internal docstring
    assert "object storage" in top.stdout and "mount" in top.stdout
    ver = run_tierfs("--version")
    assert ver.returncode == 0 and ver.stdout.startswith("tierfs ") and ver.stdout.split()[1][0].isdigit()
    mount = run_tierfs("mount", "--help")
    options = mount.stdout[mount.stdout.index("options:"):]
    cache_dir_help = options[options.index("--cache-dir"):].split("--cache-size")[0]
    assert "default" in cache_dir_help and "tierfs" in cache_dir_help, cache_dir_help
    helps = {a: run_tierfs("cache", a, "--help").stdout for a in ("ls", "evict", "verify", "stats")}
    assert len(set(helps.values())) == 4  # one text per subcommand
    assert "PATH" in helps["evict"] and "checksum" in helps["verify"]


def test_flush_takes_a_path_relative_to_the_mount_root(
    mount_factory: MountFactory, bucket: str, s3_server: SeaweedServer, tmp_path: Path
) -> None:
    m = mount_factory(f"s3://{bucket}")
    (m.mountpoint / "ckpt/step-1").mkdir(parents=True)
    (m.mountpoint / "ckpt/step-1/model.pt").write_bytes(b"w" * 4096)
    res = subprocess.run([*TIERFS, "flush", str(m.mountpoint), "ckpt/step-1"], cwd=tmp_path,
                         env=m.env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    body = s3_server.client().get_object(Bucket=bucket, Key="ckpt/step-1/model.pt")["Body"]
    assert body.read() == b"w" * 4096
    res = run_tierfs("flush", str(m.mountpoint), "../elsewhere", env=m.env)
    assert "not under the mount" in one_line_error(res)


def test_cache_dir_in_use_hint_only_when_it_helps(
    mount_factory: MountFactory, bucket: str, tmp_path: Path
) -> None:
    m = mount_factory(f"s3://{bucket}")
    mp = tmp_path / "second"
    mp.mkdir()
    res = run_tierfs("mount", f"s3://{bucket}", str(mp), "--cache-dir", str(m.cache_dir),
                     env=m.env)
    err = one_line_error(res)
    assert "in use" in err and "pass --cache-dir" not in err


def test_config_check_reports_every_error(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(
        'source = "s3://bucket"\n'
        'mountpoint = "/mnt/x"\n'
        "bogus = 1\n"
        "[cache]\n"
        'size = "lots"\n'
        "[store]\n"
        'endpoint_url = "127.0.0.1:9000"\n'
        "[classes.dataset]\n"
        'write_mode = "nope"\n'
    )
    res = run_tierfs("config", "check", str(cfg))
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert [ln.split(":")[1] for ln in lines] == ["3", "5", "7", "9"], lines
    assert all(ln.startswith(f"{cfg}:") for ln in lines)
