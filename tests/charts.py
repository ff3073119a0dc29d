"""The chart (helm/expertcache) rendered by a real ``helm template`` as release ``ec`` in namespace
``serving``, and the rendered documents looked up by kind and name; the services' own flags, read
from their --help, to check the chart's against."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "expertcache"
KUBE_VERSION = "1.33.0"  # what `helm template` assumes as the cluster's version
RELEASE, NAMESPACE = "ec", "serving"
FULLNAME = f"{RELEASE}-expertcache"


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120, cwd=REPO)


def template_args(values: tuple[str, ...], sets: tuple[str, ...], kube: str = KUBE_VERSION) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", kube]
    for path in values:
        args += ["-f", path]
    for item in sets:
        args += ["--set", item]
    return args


def render(helm: str, *sets: str, values: tuple[str, ...] = (), kube: str = KUBE_VERSION) -> list[dict]:
    proc = run_helm(helm, *template_args(values, sets, kube))
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (
        f"{kind}/{name}: {len(found)} found among {[(d['kind'], d['metadata']['name']) for d in docs]}"
    )
    return found[0]


def container(pod_spec: dict, name: str, *, init: bool = False) -> dict:
    (found,) = [c for c in pod_spec.get("initContainers" if init else "containers", []) if c["name"] == name]
    return found


def gpu_pod(docs: list[dict]) -> dict:
    return one(docs, "Deployment", f"{FULLNAME}-gpu")["spec"]["template"]


def predictor_pod(docs: list[dict]) -> dict:
    return one(docs, "Deployment", f"{FULLNAME}-predictor")["spec"]["template"]


@cache
def service_flags(module: str) -> frozenset[str]:
    """The long options a service's command line knows, read from its --help."""
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stderr
    return frozenset(re.findall(r"(--[a-z][a-z0-9-]*)", proc.stdout))
