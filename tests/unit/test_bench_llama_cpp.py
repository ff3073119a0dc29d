"""bench.llama_cpp where llama.cpp cannot be built: the build says why in one line, the benchmarks
print that line and go on with the other systems; and their --systems / --check-tokens handling.
No real build: the sdist given is not a tarball, and the benchmarks stop at the model build."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import e2e, llama_cpp, overhead
from bench.confine import Confinement
from devtools.launch import REPO


class Stop(Exception):
    """Raised in place of the model build: what the benchmark chose to run is on ``args``."""


@pytest.fixture
def unbuildable(tmp_path, monkeypatch):
    """A llama.cpp folder whose build failed (a bogus sdist), as ``EXPERTCACHE_LLAMA_CPP_DIR``."""
    root = tmp_path / "llama.cpp"
    bogus = tmp_path / "llama_cpp_python-bogus.tar.gz"
    bogus.write_bytes(b"not a tarball")
    done = subprocess.run(
        [sys.executable, "-m", "bench.llama_cpp", "build", "--dir", str(root), "--sdist", str(bogus)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith("llama.cpp cannot be built: ") and "could not be unpacked" in lines[-1]
    monkeypatch.setenv(llama_cpp.DIR_ENV, str(root))
    monkeypatch.delenv(llama_cpp.OFF_ENV, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the benchmarks set it; restored after the test
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    return root


def stop_at_build(monkeypatch, module) -> list:
    seen = []

    def build(args):
        seen.append(args)
        raise Stop

    monkeypatch.setattr(module, "build_from_args", build)
    return seen


def test_a_failed_build_is_reported_and_the_rest_run(unbuildable, tmp_path, monkeypatch, capsys):
    reason = llama_cpp.status()
    assert reason.startswith("cannot be built here: the sdist ") and "`make llama-cpp` tries again" in reason
    assert llama_cpp.choose(["resident", "llama.cpp"]) == (["resident"], f"llama.cpp: not run: {reason}")
    assert llama_cpp.choose(["resident"]) == (["resident"], None)
    trace = tmp_path / "trace.npz"
    trace.touch()
    for module, rest in (
        (e2e, "ours,lru,resident,transformers,accelerate"),
        (overhead, "resident,lru,transformers"),
    ):
        assert llama_cpp.SYSTEM in module.SYSTEMS  # in the default list
        seen = stop_at_build(monkeypatch, module)
        with pytest.raises(Stop):
            module.main(["--trace", str(trace), "--data-dir", str(tmp_path)])
        assert seen[-1].systems == rest
        assert f"llama.cpp: not run: {reason}" in capsys.readouterr().out
        with pytest.raises(Stop):  # asked for by name: the same line, and the rest run
            module.main(
                ["--trace", str(trace), "--data-dir", str(tmp_path), "--systems", "resident,llama.cpp"]
            )
        assert seen[-1].systems == "resident"
        assert f"llama.cpp: not run: {reason}" in capsys.readouterr().out


def test_not_built_off_and_argument_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(llama_cpp.DIR_ENV, str(tmp_path / "nothing"))
    monkeypatch.delenv(llama_cpp.OFF_ENV, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    assert llama_cpp.status().startswith("not built in ") and "make llama-cpp" in llama_cpp.status()
    monkeypatch.setenv(llama_cpp.OFF_ENV, "off")
    assert llama_cpp.status() == f"left out ({llama_cpp.OFF_ENV}=off)"
    trace = tmp_path / "trace.npz"
    trace.touch()
    common = ["--trace", str(trace), "--data-dir", str(tmp_path)]
    for module in (e2e, overhead):
        stop_at_build(monkeypatch, module)
        with pytest.raises(SystemExit) as exit_:  # nothing else to run
            module.main([*common, "--systems", "llama.cpp"])
        assert exit_.value.code == 2
        err = capsys.readouterr()
        assert (
            "llama.cpp: not run: left out" in err.out and "nothing left to run without llama.cpp" in err.err
        )
        with pytest.raises(SystemExit):
            module.main([*common, "--systems", "resident,llama"])
        assert "llama.cpp" in capsys.readouterr().err  # among the choices
        with pytest.raises(SystemExit):
            module.main([*common, "--check-tokens", "-1"])
        assert "--check-tokens must be >= 0" in capsys.readouterr().err


def test_greedy_check_says_where_and_why_tokens_differ(capsys):
    bf16 = {"tokens": [5, 6, 7, 8], "margins": [1.0, 0.02, 0.5, 0.5]}
    same = llama_cpp.greedy_check([5, 6, 7, 8, 9], {"bfloat16": bf16}, "bf16", 4)
    assert same["agree"] and same["n"] == 4
    assert "the first 4 agree with transformers'" in capsys.readouterr().out
    # transformers differs from itself in f32 arithmetic: rounding decides, said so
    chaotic = {"bfloat16": bf16, "float32": {"tokens": [5, 6, 3, 3]}}
    differ = llama_cpp.greedy_check([5, 9, 7, 8], chaotic, "mxfp4", 4)
    assert not differ["agree"] and differ["agreeing_prefix"] == 1
    assert differ["transformers_margin_at_divergence"] == pytest.approx(0.02)
    assert differ["transformers_bf16_vs_float32_prefix"] == 2 and differ["agreeing_prefix_float32"] == 1
    out = capsys.readouterr().out
    assert "then differ at token 1 (llama.cpp 9, transformers 6" in out
    assert "cannot be expected to agree" in out and "Q8_0" in out
    # transformers agrees with itself: not rounding, said so
    steady = {"bfloat16": bf16, "float32": {"tokens": [5, 6, 7, 8]}}
    assert "may differ from the checkpoint" in llama_cpp.greedy_check([5, 9, 7, 8], steady, "bf16", 4)["why"]
    assert llama_cpp.greedy_check([5], None, "bf16", 4) == {"checked": False}


FAKE_DRIVER = """#!{python}
import json, sys
with open({argv_file!r}, "w") as f:
    json.dump(sys.argv[1:], f)
print(json.dumps({{"ready": True, "n_vocab": 8, "system_info": "fake"}}), flush=True)
for line in sys.stdin:
    n = int(line.split()[0])
    print(json.dumps({{"first_s": 0.01, "latencies_s": [0.002] * (n - 1), "tokens": [1] * n, "cpu_s": 0.05}}), flush=True)
"""


class RecordedLimit(Confinement):
    """No cgroup: records the budget each ``limit`` was asked for."""

    def __init__(self, label: str) -> None:
        super().__init__(label, enabled=False)
        self.limits: list[tuple[int, tuple[str, ...]]] = []

    def limit(self, budget_bytes: int, budget_kinds: tuple[str, ...] = ("shmem",)) -> None:
        self.limits.append((budget_bytes, budget_kinds))


@pytest.mark.parametrize("budget", [None, 5 << 20])
def test_the_budgeted_llama_cpp_runs_from_its_map_held_to_the_experts_budget(tmp_path, budget):
    argv_file = tmp_path / "argv.json"
    driver = llama_cpp.paths(tmp_path).driver
    driver.parent.mkdir(parents=True)
    driver.write_text(FAKE_DRIVER.format(python=sys.executable, argv_file=str(argv_file)))
    driver.chmod(0o755)
    summary = {"file_bytes": 40 << 20, "expert_bytes": 32 << 20, "expert_bytes_by_type": {"MXFP4": 32 << 20}}
    memory = RecordedLimit("x")
    system = llama_cpp.LlamaCppSystem(
        tmp_path / "m.gguf",
        summary,
        threads=1,
        tokens=4,
        prompt=(1, 2),
        root=tmp_path,
        memory=memory,
        budget_bytes=budget,
    )
    try:
        system.begin()
        system.measure(0, 0)
        got = system.finish()
    finally:
        system.stop()
    args = json.loads(argv_file.read_text())
    if budget is None:
        assert system.system == llama_cpp.SYSTEM and args[-1] != "mapped"
        assert memory.limits == [(40 << 20, ("shmem", "mapped_file"))]  # the whole GGUF
    else:
        assert system.system == llama_cpp.BUDGETED and args[-1] == "mapped"
        # the GGUF's dense bytes + the experts' budget, the mapped GGUF counted as the budget's
        assert memory.limits == [((8 << 20) + budget, ("shmem", "mapped_file"))]
    assert list(got["cpu_s_per_token"]) == [system.system]
    assert got["cpu_s_per_token"][system.system] == pytest.approx(0.05 / 4)
    assert got["bytes_per_token"] >= 0 and len(got["latencies_s"]) == 3


def test_the_budgeted_llama_cpp_needs_a_budget_and_is_judged_against_ours(tmp_path, capsys):
    from argparse import Namespace

    from bench import e2e_report, systems

    args = Namespace(threads=1, tokens=4, device="cpu", cgroups=False)
    with pytest.raises(ValueError, match="needs the experts' budget"):
        systems.start_peer(llama_cpp.BUDGETED, tmp_path, (tmp_path / "m.gguf", {}), args)
    assert llama_cpp.BUDGETED in e2e.SYSTEMS and llama_cpp.BUDGETED in systems.PEERS
    assert llama_cpp.choose(["ours", llama_cpp.BUDGETED], tmp_path / "nothing")[0] == ["ours"]

    def ran(p50_s: float) -> dict:
        return {"p50_s": p50_s, "latencies_by_repeat_s": [[p50_s]]}

    verdicts = e2e_report.judge({"ours": ran(0.05), llama_cpp.BUDGETED: ran(0.2)}, "mxfp4")
    assert verdicts[f"ours_vs_{llama_cpp.BUDGETED}"]["p50_speedup"] == pytest.approx(4.0)
    assert verdicts[f"ours_vs_{llama_cpp.BUDGETED}"]["verdict"] == "PASS"
    assert f"ours vs {llama_cpp.BUDGETED}: 4.00x faster per token" in capsys.readouterr().out
    verdicts = e2e_report.judge({"ours": ran(0.15), llama_cpp.BUDGETED: ran(0.2)}, "mxfp4")
    assert verdicts[f"ours_vs_{llama_cpp.BUDGETED}"]["verdict"] == "FAIL"
