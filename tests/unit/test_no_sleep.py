"""No sleep loop on a request path: waiting is on events (conditions, futex words, host
functions), never on a timer, neither by sleeping nor by waiting in fixed slices in a loop.
Checked in the services' and the shared package's code, and in the native core; the developer
tools (devtools/: launcher, demo, test redis-server) serve no request and are not checked."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("cache_daemon", "compute_svc", "predictor_svc", "expertcache")
# Tools outside any request path, each with why it sleeps.
ALLOWED = {
    "expertcache/feed_trace.py": "a CLI that paces a trace fed to a predictor at a requested token rate",
}
# Fixed-slice waits left in place, each with why (see ``polls``).
ALLOWED_POLLS: dict[str, str] = {}  # path -> why it must poll (none today)
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


def _constants(tree: ast.Module) -> set[str]:
    """Module-level names bound to a number (``_WAIT_SLICE_S = 0.2``)."""
    names = set()
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(value, ast.Constant) and isinstance(value.value, (int, float)):
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def polls(path: Path) -> list[int]:
    """Lines of ``path`` that wait in fixed slices: a ``.wait(X)`` / ``.wait(timeout=X)`` inside a
    ``while`` loop, X a number or a module-level name bound to one. Such a loop re-checks its
    condition on a timer instead of being woken by what it waits for. A bounded wait whose
    bound is computed (a deadline's remainder, a backoff, a configured interval) is not one."""
    tree = ast.parse(path.read_text(), filename=str(path))
    constants = _constants(tree)

    def fixed(arg: ast.expr) -> bool:
        return (isinstance(arg, ast.Constant) and isinstance(arg.value, (int, float))) or (
            isinstance(arg, ast.Name) and arg.id in constants
        )

    out = []

    def visit(node: ast.AST, in_loop: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_loop = False  # a function defined in a loop runs on its own terms
        if isinstance(node, ast.Call) and in_loop:
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "wait":
                timeouts = node.args[:1] + [k.value for k in node.keywords if k.arg == "timeout"]
                if any(fixed(t) for t in timeouts):
                    out.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child, in_loop or isinstance(node, ast.While))

    visit(tree, False)
    return sorted(out)


def test_no_time_sleep_in_the_services():
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel in ALLOWED:
                continue
            found += [f"{rel}:{line}" for line in sleeps(path)]
    assert not found, f"time.sleep on a service path (wait on an event instead): {found}"


def test_no_fixed_slice_polling_in_the_services():
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel in ALLOWED or rel in ALLOWED_POLLS:
                continue
            found += [f"{rel}:{line}" for line in polls(path)]
    assert not found, f"waiting in fixed slices (wake the wait on what it waits for instead): {found}"


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


def test_the_poll_checker_finds_slices_not_bounded_waits(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text(
        "SLICE_S = 0.2\n"
        "def f(cond, event, stop, deadline, backoff):\n"
        "    while not event.is_set():\n"
        "        cond.wait(SLICE_S)\n"  # 4: a slice named in the module
        "    while not stop.wait(0.05):\n"  # 5: a literal slice in the loop's test
        "        pass\n"
        "    while True:\n"
        "        cond.wait(timeout=1)\n"  # 8: the keyword spelling
        "        cond.wait(deadline - now())\n"  # a deadline's remainder: bounded, not a poll
        "        stop.wait(backoff)\n"  # a backoff
        "        cond.wait()\n"  # woken by what it waits for
        "    event.wait(5.0)\n"  # one bounded wait, not in a loop
    )
    assert polls(mod) == [4, 5, 8]
