"""bench/ and the demo run with only the `ml` extra installed: no pytest (nor
the rest of the `test` extra) anywhere in what they import, tests/support
included (its one pytest module, marks.py, is the tests' own)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The `test` extra's importable packages, none of which `ml` brings.
TEST_ONLY = ("pytest", "_pytest", "pytest_trio", "pytest_timeout", "hypothesis")

PROBE = f"""
import runpy, sys
for name in {TEST_ONLY!r}:
    sys.modules[name] = None  # any import of it fails, as in an `ml`-only venv
failed = []
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    sys.path.insert(0, script.rsplit("/", 1)[0])  # as `python SCRIPT` does
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            failed.append(f"{{script}}: exit {{exc.code}}")
    except Exception as exc:
        failed.append(f"{{script}}: {{type(exc).__name__}}: {{exc}}")
print("FAILED", failed) if failed else print("OK")
"""


def test_every_bench_script_and_the_demo_start_without_pytest() -> None:
    scripts = [str(p) for p in sorted((ROOT / "bench").glob("*.py"))
               if p.name not in ("__init__.py", "common.py", "peers.py")]
    assert len(scripts) >= 10
    res = subprocess.run([sys.executable, "-c", PROBE, *scripts], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), (res.stdout, res.stderr)
    # The demo has no --help: importing what it imports is what the extra must allow.
    res = subprocess.run([sys.executable, "-c", PROBE.split("failed = []")[0]
                          + "sys.path.insert(0, '.')\nimport tests.support.seaweed, "
                          "tests.support.mount, tests.support.errnos\n"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
