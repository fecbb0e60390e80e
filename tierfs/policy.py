"""Path -> class rules (DESIGN §2). Pure: no I/O, no state beyond the rules."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tierfs.config import ClassSettings, ConfigError
from tierfs.globs import glob_to_regex


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
