"""The `tophat` command line as a whole (issue 46, "One CLI"): `tophat --help` is fast because importing the app
loads neither torch nor transformers (every command imports what it runs inside its body)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_python(*args: str) -> subprocess.CompletedProcess:
    """A fresh interpreter in the repository root (its modules first on the path), as `tophat` runs."""
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)


def test_importing_the_app_loads_no_model_library():
    code = "import sys, tophat.cli; print(','.join(m for m in ('torch', 'transformers') if m in sys.modules))"
    assert run_python("-c", code).stdout.strip() == ""


def test_help_is_fast():
    start = time.monotonic()
    result = run_python("-m", "tophat", "--help")
    elapsed = time.monotonic() - start
    assert "serve" in result.stdout or "up" in result.stdout
    assert elapsed < 1.5, f"`tophat --help` took {elapsed:.2f} s"
