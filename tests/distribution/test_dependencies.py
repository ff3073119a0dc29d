"""The package declares what its services import, and nothing else.

Every runtime dependency of pyproject.toml is imported by the shipped packages (a dependency no
code uses is removed, and comes back with the code that uses it), and every third-party module
they import is declared (or is a module the standard library or a declared package provides).
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIPPED = ("expertcache", "compute_svc", "cache_daemon", "predictor_svc")
# Distribution name -> the top-level modules it provides.
PROVIDES = {
    "torch": {"torch"},
    "transformers": {"transformers"},
    "tokenizers": {"tokenizers"},
    "accelerate": {"accelerate"},
    "safetensors": {"safetensors"},
    "numpy": {"numpy"},
    "grpcio": {"grpc"},
    "grpcio-health-checking": {"grpc_health"},
    "grpcio-reflection": {"grpc_reflection"},
    "protobuf": {"google"},
    "redis": {"redis"},
    "pyyaml": {"yaml"},
    "tqdm": {"tqdm"},
    "pydantic": {"pydantic"},
    "watchfiles": {"watchfiles"},
    "kubernetes": {"kubernetes"},
    # One namespace package for all of OpenTelemetry's distributions.
    "opentelemetry-api": {"opentelemetry"},
    "opentelemetry-sdk": {"opentelemetry"},
    "opentelemetry-exporter-otlp-proto-grpc": {"opentelemetry"},
    "opentelemetry-exporter-otlp-proto-http": {"opentelemetry"},
    "opentelemetry-instrumentation-grpc": {"opentelemetry"},
    "prometheus-client": {"prometheus_client"},
    "starlette": {"starlette"},
    "uvicorn": {"uvicorn"},
    "h11": {"h11"},
}
# Built by this package (the native core, the generated gRPC code).
OWN_OR_OPTIONAL = {*SHIPPED, "moe"}


def declared() -> dict[str, str]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower(): d for d in deps}


def imported_top_levels() -> set[str]:
    found: set[str] = set()
    for package in SHIPPED:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    return found


def test_every_declared_dependency_is_imported():
    imported = imported_top_levels()
    names = declared()
    assert set(names) <= set(PROVIDES), f"add the modules of {set(names) - set(PROVIDES)} to PROVIDES"
    unused = {name for name in names if not PROVIDES[name] & imported}
    assert not unused, f"declared but imported by no shipped module: {sorted(unused)}"


def test_every_third_party_import_is_declared():
    provided = set().union(*(PROVIDES[name] for name in declared()))
    third_party = {m for m in imported_top_levels() if m not in sys.stdlib_module_names and m != "__future__"}
    undeclared = third_party - provided - OWN_OR_OPTIONAL
    assert not undeclared, f"imported but not declared in pyproject.toml: {sorted(undeclared)}"
