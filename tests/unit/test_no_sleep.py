"""No sleep loop on a request path: waiting is on events (conditions, futex words, host
functions), never on a timer. Checked in the services' and the shared package's code, and in
the native core; the developer tools (devtools/: launcher, demo, test redis-server) serve no
request and are not checked."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("cache_daemon", "compute_svc", "predictor_svc", "expertcache")
# Tools outside any request path, each with why it sleeps.
ALLOWED = {
    "predictor_svc/replay.py": "a CLI that paces a trace replay at a requested token rate",
}
NATIVE_SLEEPS = re.compile(r"\b(sleep_for|sleep_until|usleep|nanosleep)\s*\(|\bsleep\s*\(")


def sleeps(path: Path) -> list[int]:
    """Lines of ``path`` that call time.sleep (as ``time.sleep`` or an imported ``sleep``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "time"
        for alias in node.names
        if alias.name == "sleep"
    }
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if (
            isinstance(f, ast.Attribute)
            and f.attr == "sleep"
            and isinstance(f.value, ast.Name)
            and f.value.id == "time"
        ):
            out.append(node.lineno)
        elif isinstance(f, ast.Name) and f.id in names:
            out.append(node.lineno)
    return out


def test_no_time_sleep_in_the_services():
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel in ALLOWED:
                continue
            found += [f"{rel}:{line}" for line in sleeps(path)]
    assert not found, f"time.sleep on a service path (wait on an event instead): {found}"


def test_no_sleep_in_the_native_core():
    found = []
    for path in sorted((REPO / "csrc").rglob("*")):
        if path.suffix not in (".cc", ".cu", ".h", ".cuh"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            code = line.split("//")[0]
            if NATIVE_SLEEPS.search(code):
                found.append(f"{path.relative_to(REPO)}:{n}")
    assert not found, f"sleeping in the native core (wait on a futex or condition instead): {found}"


def test_the_checker_finds_both_spellings(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("import time\nfrom time import sleep as nap\ndef f():\n    time.sleep(1)\n    nap(2)\n")
    assert sleeps(mod) == [4, 5]
    assert NATIVE_SLEEPS.search("  std::this_thread::sleep_for(x);")
