"""Path -> class rules (DESIGN §2). Pure: no I/O, no state beyond the rules."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from tierfs.config import ClassSettings, ConfigError


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Translate a path glob: '*' and '?' stay within a segment, '**' spans segments."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = pattern.find("]", i + 1)
            if j < 0:
                raise ConfigError(f"invalid glob {pattern!r}: unclosed '['")
            body = pattern[i + 1 : j].replace("\\", "\\\\")
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append(f"[{body}]")
            i = j + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out) + r"\Z")


@dataclass(frozen=True)
class Decision:
    settings: ClassSettings
    rule: str | None  # the glob that matched, None when the default applied


class Policy:
    """Ordered globs -> class; first match wins."""

    def __init__(
        self,
        rules: tuple[tuple[str, str], ...],
        classes: dict[str, ClassSettings],
        default_class: str,
    ) -> None:
        for _, cls in rules:
            if cls not in classes:
                raise ConfigError(f"rule names unknown class {cls!r}")
        if default_class not in classes:
            raise ConfigError(f"unknown default class {default_class!r}")
        self._rules = [
            (glob, "/" in glob, glob_to_regex(glob), classes[cls]) for glob, cls in rules
        ]
        self._default = classes[default_class]
        self.classify = lru_cache(maxsize=65536)(self._classify)

    def _classify(self, path: str) -> Decision:
        """`path` relative to the mount root, '/'-separated, no leading slash."""
        base = path.rsplit("/", 1)[-1]
        for glob, whole, rx, settings in self._rules:
            if rx.match(path if whole else base):
                return Decision(settings, glob)
        return Decision(self._default, None)

    def settings(self, path: str) -> ClassSettings:
        return self.classify(path).settings
