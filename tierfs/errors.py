"""Errors shared by the modules that must not import each other (config, globs, policy)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad option value; the message is shown to the user as one line."""
