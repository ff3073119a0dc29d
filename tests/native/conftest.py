"""Builds the native extension (the same recipe as `make native`) once per session, before any
test module imports ``expertcache.native``. make is incremental, so an up-to-date build is a no-op.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def pytest_configure(config):
    cmd = ["make", "-s", "-j4", "-f", "csrc/native.mk", "native", f"PY={sys.executable}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"building the native extension failed: {' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
        )
