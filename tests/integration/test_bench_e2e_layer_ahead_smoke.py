"""bench.e2e_layer_ahead runs end to end on one tiny architecture, and refuses bad arguments by name."""

from __future__ import annotations

import pytest

from bench import e2e_layer_ahead


def test_one_architecture_prints_its_accuracy_and_cost(capsys):
    assert e2e_layer_ahead.main(["--tokens", "2", "--layers", "3", "--archs", "mixtral"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("mixtral")]
    assert len(rows) == 1
    _, accuracy, chance, predict_us, predictions = rows[0]
    assert 0.0 <= float(accuracy) <= 1.0 and 0.0 < float(chance) < 1.0 and float(predict_us) > 0
    assert int(predictions) == 2 * 2  # every decode token, at each of the 2 MoE layers that predict


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--archs", "nope"], "--archs: nope; choose from"),
        (["--tokens", "0"], "--tokens must be >= 1"),
        (["--layers", "1"], "--layers >= 2"),
    ],
)
def test_bad_arguments_exit_2_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        e2e_layer_ahead.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
