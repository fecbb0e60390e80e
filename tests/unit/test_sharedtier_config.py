"""The shared tier's settings: [shared] in the config file, the two flags, and what
is refused with one line before any daemon starts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tierfs.cli import build_mount_config, parser
from tierfs.config import (
    SHARED_BLOCK,
    SHARED_LEASE,
    SHARED_ORIGIN_FETCHES,
    ConfigError,
    build_config,
    load_config_file,
)
from tierfs.sharedtier.setup import origin_of, read_secret


def config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "t.toml"
    path.write_text(text)
    return path


def test_shared_settings_from_file_and_flags(tmp_path: Path) -> None:
    path = config(tmp_path, """
[shared]
cache = "s3://near/fleet-a"
endpoint_url = "http://cache:8333"
access_key_id = "AKIDEXAMPLE"
secret_access_key = "very-secret"
block_size = "8M"
lease = 12
origin_fetches = 3
""")
    args = parser().parse_args(["mount", "s3://models", str(tmp_path / "m"), "--config", str(path),
                                "--shared-cache", "s3://nearer"])
    cfg = build_mount_config(args)
    assert (cfg.shared_cache, cfg.shared_endpoint_url) == ("s3://nearer", "http://cache:8333")
    assert (cfg.shared_block_size, cfg.shared_lease, cfg.shared_origin_fetches) == (
        8 << 20, 12.0, 3)
    assert "very-secret" not in repr(cfg) and "AKIDEXAMPLE" not in repr(cfg)
    plain = build_config(None, "s3://models", tmp_path / "m")
    assert (plain.shared_cache, plain.shared_block_size, plain.shared_lease,
            plain.shared_origin_fetches) == (None, SHARED_BLOCK, SHARED_LEASE, SHARED_ORIGIN_FETCHES)


@pytest.mark.parametrize(("text", "reason"), [
    ('[shared]\ncache = "file:///tmp/x"\n', "shared cache must be s3://BUCKET[/PREFIX]"),
    ('[shared]\ncach = "s3://near"\n', "unknown key 'cach' in [shared]"),
    ('[shared]\nlease = 0\n', "shared.lease: expected a positive number of seconds"),
    ('[shared]\norigin_fetches = 0\n', "shared.origin_fetches: expected a positive integer"),
    ('[shared]\nendpoint_url = "cache:8333"\n', "must start with http:// or https://"),
])
def test_bad_shared_settings_name_their_line(tmp_path: Path, text: str, reason: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config_file(config(tmp_path, text))
    assert str(err.value).startswith(f"{tmp_path / 't.toml'}:2: ")
    assert reason in str(err.value)


@pytest.mark.parametrize(("extra", "reason"), [
    ({"shared_access_key_id": "a"}, "needs both access_key_id and secret_access_key"),
    ({"shared_profile": "p", "shared_access_key_id": "a", "shared_secret_access_key": "b"},
     "names a profile and keys"),
    ({"shared_block_size": (1 << 20) + 4096}, "must be a multiple of the tier-1 chunk"),
    ({"shared_endpoint_url": "cache:8333"}, "must start with http"),
])
def test_settings_that_do_not_hang_together(tmp_path: Path, extra: dict[str, object],
                                            reason: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(reason)):
        build_config(None, "s3://models", tmp_path / "m", shared_cache="s3://near", **extra)


def test_a_bad_shared_cache_flag_is_one_line_and_a_failure(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "tierfs", "mount", "s3://models",
                          str(tmp_path / "m"), "--shared-cache", "/local/dir"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert res.stderr.strip().count("\n") == 0
    assert "shared cache must be s3://BUCKET[/PREFIX]" in res.stderr


def test_the_secret_file(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"too short\n")
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        read_secret(short)
    with pytest.raises(ConfigError, match="No such file"):
        read_secret(tmp_path / "absent")
    good = tmp_path / "good"
    good.write_bytes(b"0123456789abcdef0123\n")
    good.chmod(0o600)
    assert read_secret(good) == b"0123456789abcdef0123"


def test_blocks_are_named_by_bucket_and_full_key_not_endpoint() -> None:
    assert origin_of("s3://models/llm/v2") == {"source": "s3://models", "prefix": "llm/v2/"}
    assert origin_of("s3://models") == {"source": "s3://models", "prefix": ""}
