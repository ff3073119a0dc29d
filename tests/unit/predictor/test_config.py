"""PredictorConfig: defaults, precedence (CLI > env > file > default), errors naming the field."""

from __future__ import annotations

import pytest

from expertcache.config_loader import load_config
from expertcache.errors import InvalidArgument
from predictor_svc.__main__ import main
from predictor_svc.config import ENV_PREFIX, PredictorConfig
from predictor_svc.eam import EamShape


def test_defaults_are_valid():
    config = load_config(PredictorConfig, env={}, env_prefix=ENV_PREFIX)
    assert config.listen_address == "127.0.0.1:50070"
    assert config.eamc_capacity == 512
    assert config.redis_url == ""
    assert config.store_kind == "embedded"
    assert config.shapes() == {}


def test_precedence_cli_env_file(tmp_path):
    path = tmp_path / "predictor.yaml"
    path.write_text("eamc_capacity: 100\nhint_top_n: 3\nmin_score: 0.2\nmodel_shapes: [a=2x8x2, b=4x16x4]\n")
    env = {f"{ENV_PREFIX}HINT_TOP_N": "5", f"{ENV_PREFIX}REDIS_URL": "redis://127.0.0.1:1/0"}
    config = load_config(PredictorConfig, cli={"min_score": "0.5"}, env=env, env_prefix=ENV_PREFIX, file=path)
    assert (config.eamc_capacity, config.hint_top_n, config.min_score) == (100, 5, 0.5)
    assert config.store_kind == "redis"
    assert config.shapes() == {"a": EamShape(2, 8, 2), "b": EamShape(4, 16, 4)}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"eamc_capacity": "0"}, "'eamc_capacity' = 0 is below its minimum 1"),
        ({"min_score": "1.5"}, "'min_score' = 1.5 is above its maximum 1.0"),
        ({"listen_address": "nowhere"}, "'listen_address' = 'nowhere' is not host:port"),
        ({"redis_url": "http://x"}, "'redis_url' = 'http://x' must start with redis://"),
        ({"model_shapes": "m=24x32"}, "'model_shapes' entry 'm=24x32' is not MODEL_ID=LAYERSxEXPERTSxTOP_K"),
        ({"model_shapes": "m=2x4x8"}, "top_k <= experts"),
        ({"model_shapes": "m=2x4x2,m=2x4x2"}, "'model_shapes' names a model twice"),
        ({"log_level": "loud"}, "'log_level' = 'LOUD' is not one of"),
        ({"embedded_path": ""}, "'embedded_path' must not be empty"),
        ({"sync_interval_s": "soon"}, "'sync_interval_s' from command line: cannot read 'soon'"),
        ({"model_shapes": "m=257x8x2"}, "model 'm' has 257 layers, more than max_layers=256"),
        ({"model_shapes": "m=2x2048x2"}, "model 'm' has 2048 experts, more than max_experts=1024"),
        ({"model_shapes": "a=1x2x1,b=1x2x1", "max_models": "1"}, "names 2 models, more than max_models=1"),
        ({"model_shapes": "m=256x1024x2", "eamc_capacity": "4096"}, "more than max_eamc_bytes=2147483648"),
        ({"model_shapes": "../x=1x2x1"}, "is not MODEL_ID=LAYERSxEXPERTSxTOP_K"),
        ({"max_client_live_bytes": "0"}, "'max_client_live_bytes' = 0 is below its minimum 1"),
    ],
)
def test_bad_values_name_the_field(values, message):
    with pytest.raises(InvalidArgument, match=None) as info:
        load_config(PredictorConfig, cli=values, env={}, env_prefix=ENV_PREFIX)
    assert message in str(info.value)


def test_unknown_file_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("eamc_capacityy: 3\n")
    with pytest.raises(InvalidArgument, match="unknown field 'eamc_capacityy'"):
        load_config(PredictorConfig, env={}, env_prefix=ENV_PREFIX, file=path)


def test_main_exits_2_naming_the_field(capsys):
    assert main(["--eamc-capacity", "-1"]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err and "'eamc_capacity'" in err
