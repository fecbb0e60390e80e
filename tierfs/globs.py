"""Path globs of the class rules: '*' and '?' within a segment, '**' across segments."""

from __future__ import annotations

import re

from tierfs.errors import ConfigError


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
