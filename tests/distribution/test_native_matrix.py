"""Every configuration of the native core's optional features builds and passes the native tests.

The installed build (``make install``) has what this machine offers. A user's machine may lack
any of it, so each optional feature is also forced off, whatever is installed here: once all
together (``minimal``: zlib's CRC-32, the pread pool, no CUDA) and once alone for each feature
this machine has (``no-isal``, ``no-uring``, ``no-cuda``). Each configuration is compiled with
cmake from the same CMakeLists.txt as the package build, into ``build/matrix/<name>`` (kept, so
later runs are incremental), and the whole of tests/native runs against it in a child pytest
(``--native-lib``). A feature missing here leaves its ``no-*`` configuration skipped with the
reason: ``minimal`` covers it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MATRIX = REPO / "build" / "matrix"
# Configuration name -> the CMake feature switches it forces off.
FEATURE_NAMES = {"ISAL": "isa-l", "URING": "io_uring", "CUDA": "cuda"}
CONFIGS = {
    "minimal": ("ISAL", "URING", "CUDA"),
    "no-isal": ("ISAL",),
    "no-uring": ("URING",),
    "no-cuda": ("CUDA",),
}
BUILD_TIMEOUT_S = 900


def _cmake() -> str:
    local = Path(sys.executable).parent / "cmake"
    found = str(local) if local.exists() else shutil.which("cmake")
    if not found:
        pytest.fail("cmake is not installed: `make install` installs it into the virtual environment")
    return found


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return proc


def configure(name: str, off: tuple[str, ...]) -> Path:
    """Configure ``build/matrix/<name>`` with the features in ``off`` forced off, the rest AUTO."""
    build = MATRIX / name
    defines = [f"-DEXPERTCACHE_WITH_{f}={'OFF' if f in off else 'AUTO'}" for f in FEATURE_NAMES]
    import pybind11

    _run(
        [
            _cmake(),
            "-S",
            str(REPO),
            "-B",
            str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DEXPERTCACHE_PROTOS=OFF",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            *defines,
        ],  # fmt: skip
        timeout=300,
    )
    return build


def features_of(build: Path) -> set[str]:
    text = (build / "expertcache-features.txt").read_text().strip()
    return {FEATURE_NAMES[f] for f in text.split(";") if f}


@pytest.fixture(scope="session")
def present() -> set[str]:
    """The optional features this machine can build (a configure with everything AUTO)."""
    return features_of(configure("detect", ()))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_configuration_builds_and_passes_the_native_tests(name, present):
    off = CONFIGS[name]
    if name != "minimal" and FEATURE_NAMES[off[0]] not in present:
        pytest.skip(
            f"{FEATURE_NAMES[off[0]]} is not available on this machine: the 'minimal' build covers it"
        )
    build = configure(name, off)
    expected = present - {FEATURE_NAMES[f] for f in off}
    assert features_of(build) == expected
    _run([_cmake(), "--build", str(build), "-j", str(os.cpu_count() or 2)], timeout=BUILD_TIMEOUT_S)
    (lib,) = build.glob("_native*.so")

    # What the build says of itself, loaded in a child (this process holds the installed one).
    probe = f"""
import importlib.util, json
spec = importlib.util.spec_from_file_location("expertcache._native", {str(lib)!r})
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
pin_error = ""
if not m.CUDA_BUILT:
    try:
        m.HostPool(2, 100, pin=True)
    except RuntimeError as e:
        pin_error = str(e)
print(json.dumps({{"features": m.FEATURES, "crc": m.CRC32_IMPL, "cuda": m.CUDA_BUILT,
                  "uring": m.Reader.uring_available()[0] if hasattr(m.Reader, "uring_available") else None,
                  "pin_error": pin_error}}))
"""
    info = json.loads(_run([sys.executable, "-c", probe], timeout=60).stdout)
    assert set(info["features"]) == expected
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    pclmul = "pclmulqdq" in flags and "sse4_1" in flags
    assert info["crc"] == ("isa-l" if "isa-l" in expected else "pclmul" if pclmul else "zlib")
    assert info["cuda"] is ("cuda" in expected)
    if not info["cuda"]:
        assert info["pin_error"].startswith("cannot pin host memory: this build has no CUDA path")

    # The native tests, against this build.
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/native",
            f"--native-lib={lib}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert child.returncode == 0, f"tests/native failed against the {name} build:\n{child.stdout[-8000:]}"
