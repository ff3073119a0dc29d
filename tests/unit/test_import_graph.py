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


# -- circles ----------------------------------------------------------------------------------------
def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_arrows(packages: tuple[str, ...] = RUNTIME, root: Path = REPO) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` it imports (``from a import b`` names module ``a.b``
    when there is one, else ``a``), anywhere in the file: type-only and function-level too."""
    paths = {module_name(p, root): p for package in packages for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name in paths)
            elif isinstance(node, ast.ImportFrom):
                prefix = base[: len(base) - node.level + 1] if node.level else []
                source = ".".join(prefix + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{source}.{alias.name}"
                    found.add(target if target in paths else source)
        graph[module] = {m for m in found if m in paths and m != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return found


def test_no_import_circle_in_the_runtime():
    """No module of the services or of ``expertcache`` reaches itself through imports, counting
    type-only and function-level ones: each room is built from the rooms below it."""
    found = circles(import_arrows())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_circle_check_sees_a_type_only_circle(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import B\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
    )
    (package / "c.py").write_text("from . import a\n")
    graph = import_arrows(("pkg",), tmp_path)
    assert graph["pkg.c"] == {"pkg.a"}
    assert circles(graph) == [["pkg.a", "pkg.b"]]
