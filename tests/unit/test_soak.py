"""``make test-soak``'s counting (devtools/soak.py): JUnit reports of several runs read, every test
that failed or errored in at least one run listed with the number of runs it failed in."""

from __future__ import annotations

from devtools.soak import aggregate, main, parse_junit


def junit_run(counts: str, flaky_failure: str, others: str) -> str:
    """One run's report as pytest writes it with -o junit_family=xunit1 (a ``file`` on each
    testcase): ``counts``, the suite's attributes; test_prefetch_exec's test_ok passed and its
    test_flaky failed with ``flaky_failure``, as in every run; then the ``others`` testcases."""
    return f"""<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" {counts}>
  <testcase classname="tests.unit.daemon.test_prefetch_exec" name="test_ok"
            file="tests/unit/daemon/test_prefetch_exec.py" line="3" time="0.1"/>
  <testcase classname="tests.unit.daemon.test_prefetch_exec" name="test_flaky"
            file="tests/unit/daemon/test_prefetch_exec.py" line="9" time="0.2">
    <failure message="AssertionError">{flaky_failure}</failure></testcase>
{others}</testsuite></testsuites>
"""


RUN_1 = junit_run(
    'errors="1" failures="1" skipped="1" tests="5"',
    "boom",
    """  <testcase classname="tests.integration.test_compute_hostile_prompts"
            name="test_refused[refused-after-tokenising]"
            file="tests/integration/test_compute_hostile_prompts.py" line="60" time="9">
    <error message="fixture failed">setup</error></testcase>
  <testcase classname="tests.unit.test_x.TestGroup" name="test_in_class[a.b]"
            file="tests/unit/test_x.py" line="20" time="0.1"/>
  <testcase classname="tests.unit.test_x" name="test_skipped" file="tests/unit/test_x.py" line="30">
    <skipped message="no GPU" type="pytest.skip">no GPU</skipped></testcase>
""",
)
RUN_2 = junit_run(
    'errors="0" failures="2" skipped="0" tests="3"',
    "boom again",
    """  <testcase classname="tests.unit.test_x.TestGroup" name="test_in_class[a.b]"
            file="tests/unit/test_x.py" line="20" time="0.1">
    <failure message="AssertionError">once</failure></testcase>
""",
)
FLAKY = "tests/unit/daemon/test_prefetch_exec.py::test_flaky"
HOSTILE = "tests/integration/test_compute_hostile_prompts.py::test_refused[refused-after-tokenising]"
IN_CLASS = "tests/unit/test_x.py::TestGroup::test_in_class[a.b]"


def test_a_report_names_its_failed_and_errored_tests_by_node_id():
    report = parse_junit(RUN_1)
    assert report.tests == 5
    assert report.failed == {FLAKY, HOSTILE}


def test_failures_are_counted_over_the_runs_most_first():
    summary = aggregate([parse_junit(RUN_1), parse_junit(RUN_2), "run 3 (pytest exited with 2)"])
    assert dict(summary.failures) == {FLAKY: 2, HOSTILE: 1, IN_CLASS: 1}
    assert summary.lines() == [
        "failed at least once in 3 runs:",
        f"  2/3  {FLAKY}",
        f"  1/3  {HOSTILE}",
        f"  1/3  {IN_CLASS}",
        "  no report: run 3 (pytest exited with 2)",
    ]


def test_without_a_file_the_node_id_comes_from_the_classname():
    report = parse_junit(
        '<testsuite><testcase classname="tests.unit.test_y" name="test_z"><failure/></testcase></testsuite>'
    )
    assert report.failed == {"tests/unit/test_y.py::test_z"}


def test_runs_without_failures_say_so():
    passed = '<testsuite><testcase classname="tests.unit.test_y" name="test_z" file="tests/unit/test_y.py"/></testsuite>'
    assert aggregate([parse_junit(passed)] * 2).lines() == ["no test failed in 2 runs"]


def test_the_script_runs_pytest_and_counts_what_failed(tmp_path, capsys):
    tests = tmp_path / "test_fake.py"
    tests.write_text("def test_passes():\n    pass\n\ndef test_fails():\n    assert False\n")
    out = tmp_path / "soak"
    argv = [
        "--runs",
        "1",
        "--out",
        str(out),
        "--",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(tmp_path),
        str(tests),
    ]
    assert main(argv) == 1
    assert sorted(p.name for p in out.iterdir()) == ["run-1.log", "run-1.xml"]
    assert "  1/1  test_fake.py::test_fails" in capsys.readouterr().out.splitlines()
