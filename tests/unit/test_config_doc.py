"""docs/configuration.md says what tierfs/config.py does: every config key and
class setting is documented, with the default the code has; every flag of
`tierfs mount` and every `-o` option of mount.tierfs is named."""

from __future__ import annotations

import argparse
import re
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from tierfs import config
from tierfs.cli import parser
from tierfs.cli_ops import HELPER_OPTS

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _sections(text: str) -> dict[str, list[list[str]]]:
    """Heading line -> the cells of every table row under it (to the next heading)."""
    out: dict[str, list[list[str]]] = {}
    rows: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("#"):
            rows = out.setdefault(line, [])
        elif line.startswith("|") and not set(line) <= set("|-: "):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return out


def _literal(cell: str) -> Any:
    """The TOML value of a cell written as one backticked literal, else None."""
    m = re.fullmatch(r"`([^`]+)`", cell)
    if not m:
        return None
    try:
        return tomllib.loads(f"v = {m.group(1)}")["v"]
    except tomllib.TOMLDecodeError:
        return None


def _rows_of(table: str, sections: dict[str, list[list[str]]]) -> dict[str, list[str]]:
    want = "Top level" if table == "" else f"[{table}]"
    rows: dict[str, list[str]] = {}
    for heading, got in sections.items():
        if want in heading:
            for cells in got:
                name = cells[0].strip("`")
                rows[name.removeprefix(f"{table}.")] = cells
    return rows


DEFAULTS = {f.name: f.default for f in fields(config.MountConfig)}


def test_every_config_key_is_documented_with_its_default() -> None:
    sections = _sections((DOCS / "configuration.md").read_text())
    missing, wrong, checked = [], [], 0
    for (table, key), (field, convert) in config._KEYS.items():
        row = _rows_of(table, sections).get(key)
        if row is None:
            missing.append(f"{table}.{key}" if table else key)
            continue
        value = _literal(row[1])
        if value is None:  # a default computed at mount, said in words
            continue
        want = config.READAHEAD if field == "readahead" else DEFAULTS[field]
        got = convert(value)
        if isinstance(want, tuple):
            got = tuple(got)
        checked += 1
        if got != want:
            wrong.append(f"{table}.{key}: doc {row[1]} is {got!r}, code {want!r}")
    for key in config._TOP_SPECIAL - {"rules"}:
        if key not in _rows_of("", sections):
            missing.append(key)
    assert not missing, f"config keys missing from docs/configuration.md: {missing}"
    assert not wrong, wrong
    assert checked > 25  # the parse saw the tables


def test_every_class_setting_is_documented_with_each_classes_default() -> None:
    sections = _sections((DOCS / "configuration.md").read_text())
    [heading] = [h for h in sections if "[classes.NAME]" in h]
    rows = sections[heading]
    header = [c.strip("`") for c in rows[0]]
    by_key = {cells[0].strip("`"): cells for cells in rows[1:]}
    assert set(by_key) >= set(config._CLASS_KEYS), set(config._CLASS_KEYS) - set(by_key)
    wrong = []
    for key, convert in config._CLASS_KEYS.items():
        for name, settings in config.DEFAULT_CLASSES.items():
            cell = by_key[key][header.index(name)]
            value = _literal(cell)
            assert value is not None, f"classes.{name}.{key}: {cell!r} is not a TOML value"
            if convert(value) != getattr(settings, key):
                wrong.append(f"classes.{name}.{key}: doc {cell}, code {getattr(settings, key)!r}")
    assert not wrong, wrong


def test_every_mount_flag_and_mount_option_is_named() -> None:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {s for a in sub.choices["mount"]._actions if a.help != argparse.SUPPRESS
             for s in a.option_strings} - {"-h", "--help"}  # internal flags are hidden
    text = (DOCS / "configuration.md").read_text()
    assert not {f for f in flags if f"`{f}" not in text and f"{f}`" not in text}
    ops = (DOCS / "operations.md").read_text()
    assert not {o for o in HELPER_OPTS if f"`{o}`" not in ops}
