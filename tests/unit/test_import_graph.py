"""The import graph runs one way: services import ``expertcache`` (and the generated ``moe`` code),
never each other, and ``expertcache`` imports no service. Neither imports the replay and research
code (``replay``) or the developer tools (``devtools``): they import the runtime, never the
reverse. A test imports the helper modules of
``tests/`` (stores, procs, predictors, ...), never another test module. Imports inside functions
count too."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("cache_daemon", "compute_svc", "predictor_svc")
RUNTIME = (*SERVICES, "expertcache")
OUTSIDE = ("replay", "devtools")  # packages the runtime never imports


def imported_names(path: Path) -> set[str]:
    """Every dotted name ``path`` imports: ``import a.b`` gives ``a.b``, ``from a import b`` gives
    ``a.b``, a relative ``from .a import b`` gives ``.a.b``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            out.update(
                f"{module}.{alias.name}" if node.module else f"{module}{alias.name}" for alias in node.names
            )
    return out


def imported_packages(path: Path) -> set[str]:
    return {name.split(".")[0] for name in imported_names(path) if not name.startswith(".")}


def is_test_module(name: str) -> bool:
    """A dotted name that goes through a test module (``test_*``) or a conftest."""
    return any(part.startswith("test_") or part == "conftest" for part in name.split("."))


def imports_among_tests() -> set[tuple[str, str]]:
    found = set()
    for path in sorted((REPO / "tests").rglob("*.py")):
        for name in imported_names(path):
            if is_test_module(name):
                found.add((path.relative_to(REPO).as_posix(), name))
    return found


def arrows(targets: tuple[str, ...]) -> set[tuple[str, str]]:
    """(module, package) for each module of the runtime importing one of ``targets`` other than its
    own package."""
    found = set()
    for package in RUNTIME:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            for target in imported_packages(path) & set(targets):
                if target != package:
                    found.add((rel, target))
    return found


def assert_none(found: set[tuple[str, str]], what: str) -> None:
    assert not found, f"{what}: " + ", ".join(f"{m} -> {t}" for m, t in sorted(found))


def test_no_service_imports_another_and_expertcache_imports_none():
    assert_none(arrows(SERVICES), "imports against the layering (module -> service it imports)")


def test_the_runtime_imports_no_replay_code_and_no_developer_tool():
    """The services and expertcache run in the images without ``replay`` and ``devtools`` (the
    wheel ships neither)."""
    assert_none(arrows(OUTSIDE), "runtime modules importing replay/ or devtools/")


def test_the_checker_sees_function_level_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n    from cache_daemon.metrics import DaemonMetrics\n    import predictor_svc.eam\n"
    )
    assert imported_packages(module) == {"cache_daemon", "predictor_svc"}


def test_no_test_module_imports_another():
    """Helpers shared between test files live in ``tests/<helper>.py``: a test file imported by
    another runs its module-level set-up twice (pytest imports it again under its own name) and
    hides what the importer depends on."""
    assert_none(
        imports_among_tests(), "test modules imported by other test files (move the helper into tests/)"
    )


def test_the_checker_sees_test_modules_however_imported(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "from tests.unit.daemon.test_store import write_store\n"
        "from tests.unit.daemon import test_store\n"
        "from .test_chart import render\n"
        "def f():\n    import test_daemon_server\n"
        "from tests.stores import write_store\n"
    )
    assert sorted(n for n in imported_names(module) if is_test_module(n)) == [
        ".test_chart.render",
        "test_daemon_server",
        "tests.unit.daemon.test_store",
        "tests.unit.daemon.test_store.write_store",
    ]
