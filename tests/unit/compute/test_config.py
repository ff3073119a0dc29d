"""ComputeConfig: defaults, precedence, constraints named in errors."""

from __future__ import annotations

import pytest

from compute_svc.config import ENV_PREFIX, ComputeConfig
from compute_svc.errors import InvalidArgument
from expertcache.config_loader import load_config


def test_defaults_and_env_prefix():
    config = load_config(
        ComputeConfig,
        cli={"store_dir": "/s"},
        env={f"{ENV_PREFIX}MAX_WAITING_REQUESTS": "3", f"{ENV_PREFIX}DEVICE": "cpu"},
        env_prefix=ENV_PREFIX,
    )
    assert config.max_waiting_requests == 3 and config.device == "cpu"
    assert config.max_new_tokens_limit == 4096
    assert config.listen_address == "127.0.0.1:50051"  # loopback by default; the chart passes 0.0.0.0
    assert config.served_model_name == ""  # the HTTP API names the checkpoint (openai_schema.served_model)


def test_cli_beats_env_beats_file(tmp_path):
    file = tmp_path / "compute.yaml"
    file.write_text("store_dir: /from-file\nmax_waiting_requests: 5\nacquire_timeout_s: 9\n")
    config = load_config(
        ComputeConfig,
        cli={"max_waiting_requests": "7"},
        env={f"{ENV_PREFIX}MAX_WAITING_REQUESTS": "6", f"{ENV_PREFIX}ACQUIRE_TIMEOUT_S": "8"},
        env_prefix=ENV_PREFIX,
        file=file,
    )
    assert (config.store_dir, config.max_waiting_requests, config.acquire_timeout_s) == ("/from-file", 7, 8.0)


@pytest.mark.parametrize(
    ("cli", "message"),
    [
        ({}, "'store_dir' is empty"),
        ({"store_dir": "/s", "device": "tpu"}, "'device' = 'tpu' is not one of auto, cpu, cuda"),
        (
            {"store_dir": "/s", "max_waiting_requests": "-1"},
            "'max_waiting_requests' = -1 is below its minimum 0",
        ),
        (
            {"store_dir": "/s", "max_new_tokens_limit": "0"},
            "'max_new_tokens_limit' = 0 is below its minimum 1",
        ),
        ({"store_dir": "/s", "daemon_connect_timeout_s": "abc"}, "'daemon_connect_timeout_s'"),
        # Bytes of the command line that are not UTF-8 (surrogate escapes) have no name to serve.
        (
            {"store_dir": "/s", "served_model_name": "tiny\udcff"},
            r"'served_model_name' = .* holds a character that is not printable",
        ),
    ],
)
def test_invalid_values_name_the_field(cli, message):
    with pytest.raises(InvalidArgument, match=message):
        load_config(ComputeConfig, cli=cli, env={}, env_prefix=ENV_PREFIX)


def test_a_step_budget_below_the_batch_size_is_refused():
    with pytest.raises(InvalidArgument, match=r"'max_batched_tokens' = 8 is below max_batch_size 16"):
        load_config(
            ComputeConfig, cli={"store_dir": "/s", "max_batched_tokens": "8", "max_batch_size": "16"}, env={}
        )
    config = load_config(ComputeConfig, cli={"store_dir": "/s", "max_batched_tokens": "0"}, env={})
    assert config.max_batched_tokens == 0  # no limit: whole prompts in one step
