"""Markers of the tests: the one module of tests/support that imports pytest
(bench/ and scripts/demo.py use the rest, which must run without it)."""

from __future__ import annotations

import os

import pytest

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
