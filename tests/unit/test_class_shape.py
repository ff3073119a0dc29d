"""The classes of the services stay small and whole: at most ``MAX_ATTRIBUTES`` instance attributes
each, and no method calls ``self.x()`` unless its class or a base defines ``x`` (a part that calls
what only a sibling mixin defines is one state cut into pieces). Plain holders are exempt: the
metrics registries (``*Metrics``), stats snapshots (``*Stats``) and the configs (``*Config``, the
ConfigMap's flat schema)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("cache_daemon", "compute_svc", "predictor_svc", "expertcache")
MAX_ATTRIBUTES = 15
HOLDERS = ("Metrics", "Stats", "Config")


@dataclass
class ClassInfo:
    where: str
    node: ast.ClassDef


def classes_of(root: Path, packages: tuple[str, ...]) -> dict[str, list[ClassInfo]]:
    out: dict[str, list[ClassInfo]] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ClassDef):
                    where = f"{path.relative_to(root).as_posix()}:{node.lineno}"
                    out.setdefault(node.name, []).append(ClassInfo(where, node))
    return out


def _methods(node: ast.ClassDef) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]


def instance_attributes(node: ast.ClassDef) -> set[str]:
    """``self.x`` assigned in any method, and the fields of a dataclass."""
    found: set[str] = set()
    for method in _methods(node):
        for sub in ast.walk(method):
            targets = (
                sub.targets
                if isinstance(sub, ast.Assign)
                else [sub.target]
                if isinstance(sub, (ast.AnnAssign, ast.AugAssign))
                else []
            )
            for target in targets:
                for part in ast.walk(target):
                    if (
                        isinstance(part, ast.Attribute)
                        and isinstance(part.value, ast.Name)
                        and part.value.id == "self"
                    ):
                        found.add(part.attr)
    if any("dataclass" in ast.unparse(d) for d in node.decorator_list):
        found |= {
            s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
        }
    return found


def _defined(node: ast.ClassDef) -> set[str]:
    names = set(instance_attributes(node))
    for statement in node.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(statement.name)
        elif isinstance(statement, ast.Assign):
            names |= {t.id for t in statement.targets if isinstance(t, ast.Name)}
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            names.add(statement.target.id)
    return names


def known_names(node: ast.ClassDef, classes: dict[str, list[ClassInfo]], seen: frozenset[int] = frozenset()):
    """What ``node`` and its bases define; None when a base lies outside the repository (its
    names are unknown here)."""
    names = _defined(node)
    for base in node.bases:
        name = ast.unparse(base).split("[")[0].split(".")[-1]
        if name in ("object", "Protocol", "Generic"):
            continue
        candidates = [c.node for c in classes.get(name, []) if id(c.node) not in seen | {id(node)}]
        if len(candidates) != 1:
            return None
        inherited = known_names(candidates[0], classes, seen | {id(node)})
        if inherited is None:
            return None
        names |= inherited
    return names


def oversized(classes: dict[str, list[ClassInfo]]) -> list[str]:
    return [
        f"{info.where} {name}: {len(attrs)} attributes"
        for name, infos in classes.items()
        if not name.endswith(HOLDERS)
        for info in infos
        if len(attrs := instance_attributes(info.node)) > MAX_ATTRIBUTES
    ]


def calls_to_undefined(classes: dict[str, list[ClassInfo]]) -> list[str]:
    out = []
    for name, infos in classes.items():
        for info in infos:
            names = known_names(info.node, classes)
            if names is None:
                continue
            for method in _methods(info.node):
                for sub in ast.walk(method):
                    if (
                        isinstance(sub, ast.Call)
                        and isinstance(sub.func, ast.Attribute)
                        and isinstance(sub.func.value, ast.Name)
                        and sub.func.value.id == "self"
                        and sub.func.attr not in names
                    ):
                        out.append(f"{info.where} {name}.{method.name} calls self.{sub.func.attr}()")
    return out


def test_no_class_of_the_services_has_more_than_fifteen_instance_attributes():
    found = oversized(classes_of(REPO, SERVICES))
    assert not found, "classes to split into parts that own their state: " + "; ".join(found)


def test_no_method_calls_what_its_class_does_not_define():
    found = calls_to_undefined(classes_of(REPO, SERVICES))
    assert not found, "calls into a sibling's methods: " + "; ".join(found)


def test_the_checks_see_a_mixin_and_a_large_class(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    fields = "\n".join(f"        self.a{i} = {i}" for i in range(16))
    (package / "m.py").write_text(
        "class Part:\n    def run(self):\n        self.sibling()\n        self.own()\n    def own(self):\n        pass\n"
        f"class Big:\n    def __init__(self):\n{fields}\n"
        "class BigMetrics:\n    def __init__(self):\n" + fields + "\n"
        "class Outside(dict):\n    def run(self):\n        self.anything()\n"
    )
    classes = classes_of(tmp_path, ("pkg",))
    assert calls_to_undefined(classes) == ["pkg/m.py:1 Part.run calls self.sibling()"]
    assert oversized(classes) == ["pkg/m.py:7 Big: 16 attributes"]
