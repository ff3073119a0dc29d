"""``pip wheel .`` gives a wheel that works on its own: native core and gRPC code inside, console
scripts that run, nothing read from a build folder and no ``.pth`` written at install.

The wheel is built the way a user builds it (``pip wheel`` with build isolation, from this
checkout) and installed with ``pip install --no-deps`` into a new virtual environment, which finds
the wheel's requirements through a path entry to this checkout's environment (installing torch
again would download gigabytes on a machine without the CPU wheel); ``pip check`` then proves every
requirement the wheel declares is met. Every command runs outside the checkout, so nothing can come
from its source tree.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = (
    "expertcache",
    "expertcache-daemon",
    "expertcache-compute",
    "expertcache-predictor",
    "expertcache-convert",
)


def _run(cmd: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    )
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheelhouse")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)], cwd=out)
    (built,) = out.glob("expertcache-*.whl")
    return built


def test_wheel_holds_the_native_core_the_grpc_code_and_the_licence(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("expertcache/_native") and n.endswith(".so") for n in names), names
    for service in ("cache", "inference", "predictor"):
        for suffix in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"):
            assert f"moe/{service}/v1/{service}{suffix}" in names
        assert f"moe/{service}/v1/__init__.py" in names
    assert any(n.endswith("licenses/LICENSE") for n in names)
    assert not any(n.startswith(("build/", "tests/", "bench/")) or n.endswith(".pth") for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    for script in SCRIPTS:
        assert f"{script} = " in text


def test_installed_wheel_runs_without_the_checkout(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    # No pip or setuptools of its own: this environment's pip installs into it (pip --python).
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = Path(
        _run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path
        ).stdout.strip()
    )
    before = set(site.glob("*.pth"))
    # The requirements (torch, transformers, grpcio ...) from this checkout's environment.
    (site / "zz_requirements_from_dev_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        cwd=tmp_path,
    )
    assert set(site.glob("*.pth")) - before == {site / "zz_requirements_from_dev_env.pth"}, (
        "the install wrote a .pth"
    )
    _run([sys.executable, "-m", "pip", "--python", str(py), "check"], cwd=tmp_path)

    for script in SCRIPTS:
        out = _run([str(env_dir / "bin" / script), "--help"], cwd=tmp_path, timeout=120).stdout
        assert f"usage: {script}" in out
    probe = (
        "import expertcache, expertcache.native as n, moe.cache.v1.cache_pb2_grpc as g; "
        "print(expertcache.__file__); print(n._native.__file__); print(g.__file__); print(n.build_summary())"
    )
    lines = _run([str(py), "-c", probe], cwd=tmp_path).stdout.splitlines()
    for path in lines[:3]:
        assert path.startswith(str(site)), f"imported from outside the installed wheel: {path}"
    assert lines[3].startswith("native core: ")
