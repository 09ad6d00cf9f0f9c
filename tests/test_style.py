"""The code follows one style: ``ruff format`` and ``ruff check`` (configured in pyproject.toml)
are clean, so CI (README's test command) fails on a file that is not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["format", "lint"])
def test_ruff_is_clean(command):
    ruff = Path(sys.executable).with_name("ruff")
    done = subprocess.run([str(ruff), *command, "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
