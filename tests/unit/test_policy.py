"""Path -> class rules: globs, order, defaults."""

from __future__ import annotations

import pytest

from tierfs.config import DEFAULT_CLASSES, DEFAULT_RULES, ConfigError, parse_seconds, parse_size
from tierfs.policy import Policy, glob_to_regex


@pytest.fixture
def policy() -> Policy:
    return Policy(DEFAULT_RULES, DEFAULT_CLASSES, "default")


@pytest.mark.parametrize(
    ("path", "cls"),
    [
        ("ckpt/step-10/.metadata", "manifest"),
        ("latest", "manifest"),
        ("run/LATEST", "manifest"),
        ("m/model.safetensors.index.json", "manifest"),
        ("ckpt/step-10/__0_0.distcp", "checkpoint"),
        ("a/b/checkpoints/anything.txt", "checkpoint"),
        ("checkpoints/x", "checkpoint"),
        ("m/model.safetensors", "checkpoint"),
        ("data/shard-000.tar", "dataset"),
        ("data/train.parquet", "dataset"),
        ("imagenet/train/n01440764/n01440764_10026.JPEG", "dataset"),
        ("coco/000000000139.jpg", "dataset"),
        ("speech/clip-0001.flac", "dataset"),
        ("arrays/x.npy", "dataset"),
        ("arrays/x.npy.tmp", "staged"),
        ("notes.txt", "default"),
        ("data/latest.txt", "default"),
        # temporary names: staged whatever their final name's class would be
        ("ckpt/step-10/.metadata.tmp", "staged"),
        ("ckpt/model.pt.tmp", "staged"),
        ("a/checkpoints/x.pt.tmp.1234", "staged"),
        ("d/.shard.tar.tmp", "staged"),
        ("dl/model.bin.partial", "staged"),
        ("dl/model.bin.incomplete", "staged"),
        ("notes.txt~", "staged"),
        ("m/.tmpA1b2C3", "staged"),
        ("tmpk3j_a9zq", "staged"),
        ("out/tmp-checkpoint-500/model.safetensors", "staged"),  # HF Trainer's staging dir
        ("tmp-checkpoint-500/config.json", "staged"),
        ("out/checkpoint-500/model.safetensors", "checkpoint"),
        ("tmpk3j_a9zq.pt", "staged"),
        ("tmp", "default"),
        ("tmp/notes.txt", "default"),
    ],
)
def test_default_rules(policy: Policy, path: str, cls: str) -> None:
    assert policy.settings(path).name == cls


def test_new_defaults_write_back_after_a_quiet_delay() -> None:
    """Issue 18: every class but manifests writes back; manifests publish behind."""
    modes = {n: (c.write_mode, c.upload_delay) for n, c in DEFAULT_CLASSES.items()}
    assert modes == {"dataset": ("writeback", 1.0), "checkpoint": ("writeback", 0.0),
                     "manifest": ("publish", 0.0), "default": ("writeback", 1.0),
                     "staged": ("writeback", 30.0)}
    assert DEFAULT_CLASSES["manifest"].publish == "background"


def test_first_match_wins_and_reports_rule() -> None:
    p = Policy((("*.json", "dataset"), ("config.json", "manifest")), DEFAULT_CLASSES, "default")
    d = p.classify("m/config.json")
    assert d.settings.name == "dataset" and d.rule == "*.json"
    assert p.classify("x.bin").rule is None


def test_glob_semantics() -> None:
    assert glob_to_regex("*.tar").match("a.tar")
    assert not glob_to_regex("*.tar").match("d/a.tar")  # '*' stays within a segment
    assert glob_to_regex("**/x/**").match("x/y")
    assert glob_to_regex("**/x/**").match("a/b/x/y/z")
    assert glob_to_regex("shard-[0-9]?.tar").match("shard-1a.tar")
    assert not glob_to_regex("[!a]*").match("abc")
    with pytest.raises(ConfigError):
        glob_to_regex("[abc")


def test_unknown_class_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown class"):
        Policy((("*.x", "nope"),), DEFAULT_CLASSES, "default")


def test_sizes_and_durations() -> None:
    assert parse_size("512M") == 512 << 20
    assert parse_size("20GiB") == 20 << 30
    assert parse_size("1.5k") == 1536
    assert parse_seconds("inf") == float("inf")
    with pytest.raises(ConfigError):
        parse_size("lots")
    with pytest.raises(ConfigError):
        parse_seconds("-1")


def test_grouped_rules_keep_first_match_order() -> None:
    """The rules run as three regex alternations (policy.py): the class is still
    the first matching rule's, whatever group each rule is in."""
    rules = (("*.a", "dataset"), ("x*", "staged"), ("**/d/**", "checkpoint"), ("xa", "manifest"),
             ("*b", "staged"), ("q?", "manifest"), ("*.a.b", "checkpoint"))
    policy = Policy(rules, DEFAULT_CLASSES, "default")
    naive = [(glob, glob_to_regex(glob), cls) for glob, cls in rules]
    names = ["y.a", "xa", "xa.a", "d/xa", "d/q.a", "e/d/zz", "qb", "q.a.b", "z.a.b", "xx", "zz",
             "qz", "d/d/d", "a"]
    for name in names:
        base = name.rsplit("/", 1)[-1]
        want = next(((g, c) for g, rx, c in naive if rx.match(name if "/" in g else base)),
                    (None, "default"))
        got = policy.classify(name)
        assert (got.rule, got.settings.name) == want, name
