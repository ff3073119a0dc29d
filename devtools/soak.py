"""Flaky tests found before users find them: the suite run again and again, failures counted.

    python -m devtools.soak --runs 3 [--load] [--out build/soak] [-- PYTEST_ARGS...]

Each run is a fresh ``pytest`` process writing a JUnit XML report (``OUT/run-N.xml``, its output in
``OUT/run-N.log``); ``--load`` keeps one busy process per core beside the runs (``stress-ng --cpu``
where it is installed), as a busy CI machine would. At the end every test that failed (or errored)
in at least one run is listed with how many runs it failed in; a run that left no report (pytest
crashed or was killed) is listed too. Exit status 1 when anything failed, else 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class RunReport:
    """One run's outcome: the tests that failed or errored, by node id; how many tests ran."""

    tests: int = 0
    failed: set[str] = field(default_factory=set)


def _node_id(case: ET.Element) -> str:
    """pytest's node id of a JUnit ``testcase``: ``path.py::Class::name`` from its ``file`` (the
    xunit1 family, which ``--junit-xml`` is asked for below) or, without one, from the dotted
    ``classname`` (``tests.unit.test_x.Class`` → ``tests/unit/test_x.py::Class``)."""
    classname = case.get("classname", "")
    name = case.get("name", "")
    path = case.get("file")
    if path and path.endswith(".py"):
        module = path[: -len(".py")].replace("/", ".")
        rest = classname[len(module) + 1 :] if classname.startswith(module + ".") else ""
        parts = [path, *(p for p in rest.split(".") if p), name]
    else:
        parts = [classname.replace(".", "/") + ".py" if classname else "?", name]
    return "::".join(parts)


def parse_junit(source: str | Path) -> RunReport:
    """The tests of one JUnit XML report (a file, or its text) that failed or errored."""
    text = Path(source).read_text() if isinstance(source, Path) else source
    root = ET.fromstring(text)
    report = RunReport()
    for case in root.iter("testcase"):
        report.tests += 1
        if case.find("failure") is not None or case.find("error") is not None:
            report.failed.add(_node_id(case))
    return report


@dataclass
class Summary:
    runs: int
    failures: Counter[str]  # node id -> runs it failed in
    missing: list[str]  # runs that left no report, each with why

    def lines(self) -> list[str]:
        if not self.failures and not self.missing:
            return [f"no test failed in {self.runs} runs"]
        out = [f"failed at least once in {self.runs} runs:"] if self.failures else []
        for node, n in sorted(self.failures.items(), key=lambda kv: (-kv[1], kv[0])):
            out.append(f"  {n}/{self.runs}  {node}")
        out += [f"  no report: {why}" for why in self.missing]
        return out


def aggregate(reports: Iterable[RunReport | str], runs: int | None = None) -> Summary:
    """Failures counted over ``reports``; a str in their place is a run that left no report (why)."""
    reports = list(reports)
    failures: Counter[str] = Counter()
    missing = []
    for report in reports:
        if isinstance(report, str):
            missing.append(report)
        else:
            failures.update(report.failed)
    return Summary(runs if runs is not None else len(reports), failures, missing)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextmanager
def cpu_load(enabled: bool) -> Iterator[str]:
    """One busy process per core while the block runs (stress-ng where present); says which."""
    if not enabled:
        yield "none"
        return
    n = cores()
    stress = shutil.which("stress-ng")
    if stress:
        procs = [subprocess.Popen([stress, "--cpu", str(n), "--quiet"], stdin=subprocess.DEVNULL)]
        what = f"stress-ng --cpu {n}"
    else:
        busy = [sys.executable, "-c", "while True: pass"]
        procs = [subprocess.Popen(busy, stdin=subprocess.DEVNULL) for _ in range(n)]
        what = f"{n} busy-loop processes"
    try:
        yield what
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def run_once(index: int, out: Path, pytest_args: list[str]) -> RunReport | str:
    """One pytest process; its report, or why there is none."""
    xml = out / f"run-{index}.xml"
    log = out / f"run-{index}.log"
    argv = [sys.executable, "-m", "pytest", "-q", "-rfE", "-o", "junit_family=xunit1", f"--junit-xml={xml}"]
    with open(log, "wb") as sink:
        code = subprocess.call([*argv, *pytest_args], cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
    if not xml.exists():
        return f"run {index} (pytest exited with {code}; see {log})"
    try:
        return parse_junit(xml)
    except ET.ParseError as exc:
        return f"run {index} ({xml} cannot be read: {exc})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="pytest runs, each a fresh process (default 3)")
    parser.add_argument("--load", action="store_true", help="a busy process per core beside the runs")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "soak", help="where the reports go")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default: tests)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("run-*.xml"), *out.glob("run-*.log")]:
        stale.unlink()
    pytest_args = args.pytest_args or ["tests"]
    reports: list[RunReport | str] = []
    with cpu_load(args.load) as load:
        print(
            f"soak: {args.runs} runs of pytest {' '.join(pytest_args)}; load beside them: {load}", flush=True
        )
        for i in range(1, args.runs + 1):
            report = run_once(i, out, pytest_args)
            reports.append(report)
            said = report if isinstance(report, str) else f"{report.tests} tests, {len(report.failed)} failed"
            print(f"soak: run {i}/{args.runs}: {said}", flush=True)
    summary = aggregate(reports)
    print("\n".join(summary.lines()))
    print(f"soak: reports in {out}")
    return 1 if summary.failures or summary.missing else 0


if __name__ == "__main__":
    sys.exit(main())
