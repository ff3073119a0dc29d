"""bench.kernels runs end to end at one small configuration, and refuses bad arguments by name."""

from __future__ import annotations

import json

import pytest

from bench import kernels
from expertcache import native


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
            "--paths",
            "auto,portable",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "vs memcpy" in printed and "goal: bf16 and MXFP4" in printed
    results = json.loads(out.read_text())["results"]
    # a line per path: auto is the fastest this CPU runs
    assert {(r["layout"], r["rows"], r["path"]) for r in results} == {
        (layout, rows, path)
        for layout in ("mxfp4", "plain-t")
        for rows in (1, 3)
        for path in (native.FFN_PATHS[0], "portable")
    }
    for r in results:
        assert r["fused_ms"] > 0 and r["memcpy_gbps"] > 0
    # MXFP4's decode alone, where a path that decodes as the avx512 and amx kernels runs
    floors = json.loads(out.read_text())["decode_only"]
    if native.FFN_PATHS[0] in ("avx512", "avx512-bf16", "amx"):
        assert [(f["shape"], f["path"]) for f in floors] == [("e2e", native.FFN_PATHS[0])]
        assert floors[0]["decode_ms"] > 0
        assert floors[0]["vs_memcpy"] == pytest.approx(floors[0]["decode_gbps"] / floors[0]["memcpy_gbps"])
        assert "MXFP4 decode alone (e2e" in printed
    else:
        assert floors == [] and "decode alone" not in printed


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rows", "0"], "--rows: each between 1 and 64"),
        (["--rows", "x"], "--rows 'x'"),
        (["--shapes", "nope"], "unknown nope"),
        (["--layouts", "int4"], "unknown int4"),
        (["--threads", "0"], "--threads 1 .. 256"),
        (["--paths", "sse"], "--paths: sse not a path of this CPU"),
    ],
)
def test_bad_arguments_exit_2_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        kernels.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
