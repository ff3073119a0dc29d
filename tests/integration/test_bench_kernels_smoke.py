"""bench.kernels runs end to end at one small configuration, and refuses bad arguments by name."""

from __future__ import annotations

import json

import pytest

from bench import kernels


def test_one_layout_prints_and_writes_its_figures(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    rc = kernels.main(
        [
            "--shapes",
            "e2e",
            "--layouts",
            "mxfp4,plain-t",
            "--rows",
            "1,3",
            "--repeats",
            "1",
            "--no-torch",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "vs memcpy" in printed and "goal: bf16 and MXFP4" in printed
    results = json.loads(out.read_text())["results"]
    assert {(r["layout"], r["rows"]) for r in results} == {
        ("mxfp4", 1),
        ("mxfp4", 3),
        ("plain-t", 1),
        ("plain-t", 3),
    }
    for r in results:
        assert r["fused_ms"] > 0 and r["memcpy_gbps"] > 0 and r["path"] in ("avx2", "portable")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rows", "0"], "--rows: each between 1 and 64"),
        (["--rows", "x"], "--rows 'x'"),
        (["--shapes", "nope"], "unknown nope"),
        (["--layouts", "int4"], "unknown int4"),
        (["--threads", "0"], "--threads 1 .. 256"),
    ],
)
def test_bad_arguments_exit_2_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        kernels.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
