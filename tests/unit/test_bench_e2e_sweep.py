"""``bench.e2e --budget-share 0.1,0.25,0.5``: one whole run per share, then ours vs lru at each
(``bench.e2e_sweep``). The runs are stood in for by a function that writes what a run writes."""

from __future__ import annotations

import json

import pytest

from bench import e2e
from bench.e2e_sweep import parse_shares, run_sweep, share_out

MIB = 1 << 20


def test_shares_are_parsed_and_checked():
    assert parse_shares("0.25") == [0.25]
    assert parse_shares("0.5,0.1,0.25") == [0.1, 0.25, 0.5]
    for text, message in (
        ("0.1,x", "not a number"),
        ("0.1,1.5", "1.5 is out of range"),
        ("0,0.5", "0.0 is out of range"),
        ("0.1,0.1", "given twice"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_shares(text)


def test_a_bad_share_list_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        e2e.main(["--budget-share", "0.1,2"])
    assert exit_.value.code == 2 and "2.0 is out of range (0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        e2e.main(["--budget-share", "0.1,0.5", "--budget-mib", "100"])
    assert exit_.value.code == 2 and "cannot go with a list" in capsys.readouterr().err


def fake_runs(p50_ms: dict[float, tuple[float, float]], calls: list[list[str]]):
    """A stand-in for bench.e2e.main: writes the report a run at that share would, with lru's and
    ours' p50 (ms) from ``p50_ms``."""

    def run(argv: list[str]) -> int:
        calls.append(argv)
        share = float(argv[len(argv) - 1 - argv[::-1].index("--budget-share") + 1])
        out = argv[len(argv) - 1 - argv[::-1].index("--out") + 1]
        lru, ours = p50_ms[share]
        report = {
            "budget_bytes": int(share * 1000 * MIB),
            "systems": {
                "lru": {"p50_s": lru / 1e3, "bytes_per_token": 10.0},
                "ours": {"p50_s": ours / 1e3, "bytes_per_token": 8.0},
            },
        }
        with open(out, "w") as f:
            json.dump(report, f)
        return 0

    return run


def test_a_sweep_runs_each_share_and_judges_ours_against_lru_at_every_one(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    calls: list[list[str]] = []
    argv = ["--systems", "ours,lru", "--out", str(out), "--budget-share", "0.1,0.5"]
    run = fake_runs({0.1: (100.0, 80.0), 0.5: (40.0, 44.0)}, calls)
    assert run_sweep(argv, [0.1, 0.5], out, run) == 0
    # Each run gets the sweep's arguments with its own share, file and ratio check last (they win).
    assert [c[len(argv) :] for c in calls] == [
        ["--budget-share", "0.1", "--out", str(share_out(out, 0.1)), "--min-ratio", "1"],
        ["--budget-share", "0.5", "--out", str(share_out(out, 0.5)), "--min-ratio", "1"],
    ]
    assert share_out(out, 0.1).name == "sweep-share0.1.json"
    # Without a suffix each share still gets a PNG of its own beside its JSON (not "...-share0.png").
    bare = [share_out(tmp_path / "sweep", s).with_suffix(".png").name for s in (0.1, 0.25)]
    assert bare == ["sweep-share0.1.png", "sweep-share0.25.png"]
    report = json.loads(out.read_text())
    rows = {row["share"]: row for row in report["rows"]}
    assert rows[0.1]["ours_vs_lru"] == pytest.approx(1.25) and rows[0.1]["verdict"] == "PASS"
    assert rows[0.5]["ours_vs_lru"] == pytest.approx(40 / 44) and rows[0.5]["verdict"] == "FAIL"
    assert rows[0.5]["bytes_vs_lru"] == pytest.approx(0.8) and rows[0.5]["budget_mib"] == pytest.approx(500)
    assert report["verdict"] == "FAIL"  # slower than lru at one share
    assert out.with_suffix(".png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "ours >= 1x lru at every share: FAIL" in printed and "budget sweep 2/2" in printed


def test_a_failed_run_ends_the_sweep_with_its_code(tmp_path):
    calls: list[list[str]] = []
    assert run_sweep([], [0.1, 0.5], tmp_path / "s.json", lambda argv: calls.append(argv) or 3) == 3
    assert len(calls) == 1 and not (tmp_path / "s.json").exists()
