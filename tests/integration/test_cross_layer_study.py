"""bench.cross_layer_study: the learned cross-layer next-visit model and its replay."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import cross_layer_study as study
from bench.replay import DEFAULT_TRACE

pytestmark = pytest.mark.integration
needs_trace = pytest.mark.skipif(not DEFAULT_TRACE.is_file(), reason=f"{DEFAULT_TRACE} is not present")


def _requests(rng, n: int, tokens: int, layers: int = 3, experts: int = 8) -> list[np.ndarray]:
    """Top-1 routing where layer 2 at token t + 1 repeats layer 0 at token t, the rest random:
    only another layer's routing tells layer 2's next expert."""
    out = []
    for _ in range(n):
        r = rng.integers(0, experts, size=(tokens, layers, 1))
        r[1:, 2] = r[:-1, 0]
        out.append(r)
    return out


def test_the_model_learns_what_another_layer_tells():
    rng = np.random.default_rng(0)
    model = study.fit(_requests(rng, 6, 60), 8, steps=300, l2=0.0)
    assert model.weights.shape == (3, 3 * 8 + 2 * 8, 8) and model.bias.shape == (3, 8)
    hits = total = 0
    for req in _requests(np.random.default_rng(1), 2, 40):
        y = study.one_hot(req, 8)
        short, long = study._histories(y, model.base)
        for t in range(1, len(y) - 1):
            latest = np.concatenate([y[t, :3], y[t - 1, 3:]])  # after layer 2 of token t: all of token t
            q = model.predict(2, latest, short[t, 2], long[t, 2])
            hits += int(np.argmax(q) == req[t + 1, 2, 0])
            total += 1
    assert hits / total > 0.9  # a layer's own history says 1 in 8


def test_fit_refuses_what_it_cannot_train_on():
    with pytest.raises(ValueError, match="steps must be >= 1 and l2 >= 0, got 0 and 0.0"):
        study.fit([np.zeros((5, 2, 1), np.int64)], 4, steps=0, l2=0.0)
    with pytest.raises(ValueError, match="no request of 3 tokens or more to train on"):
        study.fit([np.zeros((2, 2, 1), np.int64)], 4, steps=1)


@needs_trace
def test_the_study_replays_both_estimates_beside_belady(tmp_path, capsys):
    out = tmp_path / "study.json"
    assert study.main(["--first", "3", "--requests", "1", "--steps", "5", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert list(rows) == [
        "belady",
        "activation-aware, built-in estimate",
        "activation-aware, cross-layer model",
    ]
    assert rows["belady"]["x_belady"] == 1.0
    for r in rows.values():
        assert 0.0 < r["hit_rate"] <= 1.0 and r["bytes_per_token"] > 0
        assert r["x_belady"] >= 1.0  # nothing loads fewer bytes than Belady
    assert 0.0 <= report["next_visit_recall"] <= 1.0 and report["trained_on"] == [0, 2]
    printed = capsys.readouterr().out
    assert "activation-aware, cross-layer model" in printed and "x Belady" in printed


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--first", "0"], "--first must be in [1, "),
        (["--requests", "0"], "--requests must be in [1, "),
        (["--budget", "1.5"], "--budget must be in (0, 1], got 1.5"),
        (["--steps", "0"], "--steps must be in [1, 100000] and --l2 >= 0, got 0 and 0.0001"),
    ],
)
@needs_trace
def test_the_study_refuses_bad_arguments(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        study.main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
