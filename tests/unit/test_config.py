"""Config files (TOML), their checker, and the small pure pieces of operating a
mount: metrics address rules, mount.tierfs option mapping, sd_notify, logs."""

from __future__ import annotations

import logging
import math
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tierfs.cli import LogfmtFormatter
from tierfs.cli_ops import OpsError, helper_argv
from tierfs.config import (
    DEFAULT_CLASSES,
    DEFAULT_RULES,
    ConfigError,
    ConfigFileError,
    MiB,
    build_config,
    default_inflight,
    default_memory_budget,
    key_line,
    load_config_file,
    parse_listen_addr,
)
from tierfs.metrics import histogram_quantiles
from tierfs.policy import Policy
from tierfs.sdnotify import notify

EXAMPLE = Path(__file__).resolve().parents[2] / "systemd" / "tierfs.example.toml"


def write(tmp_path: Path, text: str, name: str = "t.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_example_config_loads_and_means_what_it_says() -> None:
    fs = load_config_file(EXAMPLE)
    cfg = build_config(fs, None, None)
    assert cfg.source == "s3://my-bucket/team/prefix"
    assert cfg.mountpoint == Path("/mnt/data")
    assert cfg.cache_dir == Path("/var/cache/tierfs/data")
    assert cfg.cache_size == 500 << 30
    # [read] readahead is the window of every class that does not set its own
    assert {c.readahead_max for c in cfg.classes.values()} == {64 * MiB}
    assert cfg.metrics_addr == "127.0.0.1:9464"
    assert cfg.memory_budget == 256 * MiB and cfg.max_parallel_puts == 8
    assert cfg.store_engine == "crt"
    assert math.isinf(cfg.classes["dataset"].list_ttl)
    assert [n for n, c in cfg.classes.items() if c.direct_writes] == ["checkpoint", "staged"]
    assert cfg.classes["manifest"] == replace(DEFAULT_CLASSES["manifest"], readahead_max=64 * MiB)
    # file rules first, built-ins after
    assert cfg.rules[:2] == (("shards/**", "dataset"), ("*.jsonl", "dataset"))
    assert cfg.rules[2:] == DEFAULT_RULES
    pol = Policy(cfg.rules, cfg.classes, cfg.default_class)
    d = pol.classify("shards/x/part-0.latest")
    assert (d.settings.name, d.rule) == ("dataset", "shards/**")
    assert pol.classify("a/.metadata").settings.name == "manifest"


def test_flags_override_the_file(tmp_path: Path) -> None:
    p = write(tmp_path, 'source = "s3://bkt"\nmountpoint = "/mnt/a"\n[cache]\nsize = "1G"\n'
                        '[logging]\nlevel = "warning"\n')
    cfg = build_config(load_config_file(p), None, "/mnt/b", cache_size=2 << 30, log_level=None)
    assert (cfg.source, cfg.mountpoint, cfg.cache_size, cfg.log_level) == (
        "s3://bkt", Path("/mnt/b"), 2 << 30, "warning")
    assert cfg.config_file == p
    with pytest.raises(ConfigError, match="missing SOURCE"):
        build_config(None, None, "/mnt/x")


def test_memory_defaults_follow_the_machine_and_the_budget(tmp_path: Path) -> None:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert default_memory_budget() == min(2 << 30, max(256 * MiB, ram // 16))
    assert [default_inflight(b) for b in (128 * MiB, 1 << 30, 8 << 30)] == [
        64 * MiB, 256 * MiB, 512 * MiB]
    cfg = build_config(None, "s3://bkt", "/mnt/a")
    assert cfg.memory_budget == default_memory_budget()
    assert cfg.inflight_bytes == default_inflight(cfg.memory_budget)
    p = write(tmp_path, '[memory]\nbudget = "1G"\n')
    assert build_config(load_config_file(p), "s3://bkt", "/mnt/a").inflight_bytes == 256 * MiB
    p = write(tmp_path, '[memory]\nbudget = "1G"\n[read]\nmax_inflight = "96M"\n')
    assert build_config(load_config_file(p), "s3://bkt", "/mnt/a").inflight_bytes == 96 * MiB


def test_new_class_and_replacing_the_default_rules(tmp_path: Path) -> None:
    p = write(tmp_path, 'default_rules = false\n[classes.hot]\nattr_ttl = 1\nlist_ttl = "inf"\n'
                        '[[rules]]\nglob = "hot/**"\nclass = "hot"\n')
    cfg = build_config(load_config_file(p), "s3://bkt", "/mnt/x")
    assert cfg.rules == (("hot/**", "hot"),)
    hot = cfg.classes["hot"]
    assert (hot.attr_ttl, hot.list_ttl, hot.write_mode) == (1.0, math.inf, "writeback")


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ('source = "s3://bkt"\n[cache\nsize = 1\n', 2, "TOML syntax error"),
        ('source = "s3://bkt"\nmountpoint = "/m"\n\n[cache]\ndir = "/c"\nsize = "lots"\n', 6,
         "cache.size: invalid size 'lots'"),
        ('source = "s3://bkt"\n[store]\npart_sise = "8M"\n', 3, "unknown key 'part_sise' in [store]"),
        ('[[rules]]\nglob = "*.a"\nclass = "dataset"\n\n[[rules]]\nglob = "*.b"\nclass = "nope"\n',
         7, "rules[1]: unknown class 'nope'"),
        ('[[rules]]\nglob = "*.[a"\nclass = "dataset"\n', 2, "unclosed '['"),
        ('[classes.dataset]\nattr_ttl = 5\nwrite_mode = "sometimes"\n', 3, "write_mode must be one of"),
        ('[classes.dataset]\nlist_ttl = -3\n', 2, "must be >= 0"),
        ('[classes.manifest]\npublish = "later"\n', 2, "publish must be one of"),
        ('[classes.staged]\nupload_delay = "inf"\n', 2, "finite number of seconds"),
        ('[classes.checkpoint]\ndirect_writes = "yes"\n', 2, "direct_writes"),
        ('[metrics]\naddr = "0.0.0.0:9464"\n', 2, "not loopback"),
        ('[logging]\nlevel = "loud"\n', 2, "log level must be one of"),
        ('source = "http://bkt"\n', 1, "source must be s3://"),
        ('mountpoint = "relative/dir"\n', 1, "expected an absolute path"),
        ('cache = 5\n', 1, "'cache' must be a table"),
    ],
)
def test_errors_name_the_line(tmp_path: Path, text: str, line: int, reason: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(ConfigFileError) as ei:
        load_config_file(p)
    assert ei.value.line == line, str(ei.value)
    assert reason in ei.value.reason
    assert str(ei.value).startswith(f"{p}:{line}: ")


def test_config_check_command_prints_file_line_reason(tmp_path: Path) -> None:
    bad = write(tmp_path, 'source = "s3://bkt"\nmountpoint = "/mnt/x"\n\n[read]\nreadahead = "1Q"\n',
                "bad.toml")
    res = subprocess.run([sys.executable, "-m", "tierfs", "config", "check", str(EXAMPLE), str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert f"{EXAMPLE}: ok" in res.stdout
    assert res.stderr.strip() == (
        f"{bad}:5: read.readahead: invalid size '1Q': expected e.g. 512M, 20G, 1T")


def test_key_line_finds_nested_keys() -> None:
    text = 'a = 1\n[x]\nb = 2\n[[r]]\nc = 1\n[[r]]\nc = 2\n[y.z]\nd = "#"  # note\n'
    assert key_line(text, ("x", "b")) == 3
    assert key_line(text, ("r", 1, "c")) == 7
    assert key_line(text, ("y", "z", "d")) == 9
    assert key_line(text, ("x", "nope")) == 2  # the table, when the key is not there


def test_metrics_address_rules() -> None:
    assert parse_listen_addr("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_listen_addr("[::1]:9") == ("::1", 9)
    assert parse_listen_addr("localhost:80") == ("localhost", 80)
    assert parse_listen_addr("10.1.2.3:9464", allow_remote=True) == ("10.1.2.3", 9464)
    for bad in ("10.1.2.3:9464", "0.0.0.0:1", "9464", "host:0", "example.com:80"):
        with pytest.raises(ConfigError):
            parse_listen_addr(bad)


def test_mount_helper_maps_options() -> None:
    argv = helper_argv(["s3://b/p", "/mnt/d", "-o",
                        "rw,_netdev,nofail,x-systemd.automount,cache_dir=/c,cache_size=5G,"
                        "config=/etc/tierfs/d.toml,allow_other,defaults"])
    assert argv == ["mount", "s3://b/p", "/mnt/d", "--cache-dir", "/c", "--cache-size", "5G",
                    "--config", "/etc/tierfs/d.toml", "--allow-other"]
    assert helper_argv(["s3://b", "/m", "-f", "-o", "cache_dir=/c"]) is None
    with pytest.raises(OpsError, match="unknown mount option 'colour'"):
        helper_argv(["s3://b", "/m", "-o", "colour=red"])
    assert helper_argv(["s3://b", "/m", "-s", "-o", "colour=red"]) == ["mount", "s3://b", "/m"]
    with pytest.raises(OpsError, match="needs a value"):
        helper_argv(["s3://b", "/m", "-o", "cache_dir"])


def test_histogram_quantiles_interpolate_like_prometheus() -> None:
    buckets = [(0.001, 50.0), (0.01, 90.0), (0.1, 100.0), (math.inf, 100.0)]
    q = histogram_quantiles(buckets)
    assert q["p50"] == pytest.approx(0.001)
    assert q["p95"] == pytest.approx(0.01 + 0.09 * 0.5)
    assert histogram_quantiles([(0.1, 0.0), (math.inf, 0.0)])["p99"] is None


@pytest.mark.parametrize("abstract", [False, True])
def test_sd_notify_datagram(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, abstract: bool) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        if abstract:
            name = f"tierfs-test-{os.getpid()}"
            srv.bind("\0" + name)
            monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        else:
            path = tmp_path / "notify"
            srv.bind(str(path))
            monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        srv.settimeout(5)
        assert notify("READY=1", "STATUS=ok")
        assert srv.recv(4096) == b"READY=1\nSTATUS=ok"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert notify("READY=1") is False


def test_log_lines_are_single_line_logfmt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOURNAL_STREAM", "8:1")
    fmt = LogfmtFormatter()
    try:
        raise ValueError("two\nlines")
    except ValueError:
        rec = logging.LogRecord("tierfs.x", logging.WARNING, __file__, 1, 'bad "key" %s', ("k",),
                                sys.exc_info())
    out = fmt.format(rec)
    assert "\n" not in out
    assert out.startswith('level=warning logger=tierfs.x msg="bad \\"key\\" k" exc="Traceback')


def test_read_readahead_is_the_window_of_every_class_not_setting_its_own(tmp_path: Path) -> None:
    p = write(tmp_path, 'source = "s3://bkt"\nmountpoint = "/mnt/x"\n[read]\nreadahead = "32M"\n'
                        '[classes.dataset]\nreadahead_max = "128M"\n')
    cfg = build_config(load_config_file(p), None, None)
    assert cfg.classes["dataset"].readahead_max == 128 * MiB
    assert cfg.classes["checkpoint"].readahead_max == 32 * MiB
    assert build_config(None, "s3://bkt", "/mnt/x").classes["dataset"].readahead_max == 64 * MiB


def test_owner_and_mode_defaults_from_flags_file_and_mount_options(tmp_path: Path) -> None:
    p = write(tmp_path, 'source = "s3://bkt"\nmountpoint = "/mnt/a"\nuid = 1000\n'
                        'file_mode = "640"\ndir_mode = "2750"\n')
    cfg = build_config(load_config_file(p), None, None, gid=100)
    assert (cfg.uid, cfg.gid, cfg.file_mode, cfg.dir_mode) == (1000, 100, 0o640, 0o2750)
    plain = build_config(None, "s3://bkt", "/mnt/a")
    assert (plain.uid, plain.gid, plain.file_mode, plain.dir_mode) == (None, None, 0o644, 0o755)
    for bad in ('file_mode = 644', 'file_mode = "9"', 'dir_mode = "17777"', "uid = -1"):
        with pytest.raises(ConfigFileError):
            load_config_file(write(tmp_path, bad + "\n", "bad.toml"))
    argv = helper_argv(["s3://bkt", "/mnt/a", "-o", "uid=1000,gid=100,file_mode=640,dir_mode=750"])
    assert argv is not None
    assert argv[argv.index("--uid") + 1] == "1000" and argv[argv.index("--file-mode") + 1] == "640"
    bad_flag = subprocess.run([sys.executable, "-m", "tierfs", "mount", "s3://bkt", "/mnt/a",
                               "--file-mode", "8"], capture_output=True, text=True, timeout=60)
    assert bad_flag.returncode != 0
    assert "not an octal permission mode" in bad_flag.stderr and "Traceback" not in bad_flag.stderr


def test_store_engine_key(tmp_path: Path) -> None:
    ok = tmp_path / "ok.toml"
    ok.write_text('source = "s3://bkt"\nmountpoint = "/mnt/x"\n[store]\nengine = "botocore"\n')
    assert build_config(load_config_file(ok), None, None).store_engine == "botocore"
    bad = tmp_path / "bad.toml"
    bad.write_text('[store]\nengine = "curl"\n')
    with pytest.raises(ConfigError, match="store engine must be one of crt, botocore"):
        load_config_file(bad)
