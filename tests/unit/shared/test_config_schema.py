"""One pydantic schema per service: the validator of every source and the JSON Schema printed by
``--print-config-schema`` (x-live, x-env, x-flag on each property)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import expertcache
from cache_daemon.config import ENV_PREFIX as DAEMON_PREFIX
from cache_daemon.config import LIVE_FIELDS as DAEMON_LIVE
from cache_daemon.config import DaemonConfig
from compute_svc.config import ENV_PREFIX as COMPUTE_PREFIX
from compute_svc.config import ComputeConfig
from expertcache.config_loader import config_schema, live_fields, load_config, validate
from expertcache.errors import InvalidArgument
from predictor_svc.config import ENV_PREFIX as PREDICTOR_PREFIX
from predictor_svc.config import PredictorConfig

SERVICES = [
    (DaemonConfig, DAEMON_PREFIX, "cache_daemon", {"store_dir": "/s"}),
    (PredictorConfig, PREDICTOR_PREFIX, "predictor_svc", {}),
    (ComputeConfig, COMPUTE_PREFIX, "compute_svc", {"store_dir": "/s"}),
]

DAEMON_LIVE_KEYS = {
    "device_budget_bytes",
    "host_budget_bytes",
    "eviction_policy",
    "prefetch",
    "max_inflight_bytes",
    "prefetch_horizon_layers",
    "prefetch_min_probability",
    "hint_ttl_tokens",
    "hint_stale_s",
    "next_visit_model",
}
PREDICTOR_LIVE_KEYS = {
    "eamc_capacity",
    "hint_top_n",
    "min_score",
    "match_top_n",
    "max_live_requests",
    "live_request_ttl_s",
    "min_request_tokens",
    "sync_interval_s",
    "max_pending_inserts",
}


@pytest.mark.parametrize(("cls", "prefix", "module", "_req"), SERVICES)
def test_print_config_schema_flag_prints_every_field(cls, prefix, module, _req):
    out = subprocess.run(
        [sys.executable, "-m", module, "--print-config-schema"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    schema = json.loads(out.stdout)
    assert schema["additionalProperties"] is False
    props = schema["properties"]
    assert set(props) == {f.name for f in dataclasses.fields(cls)}
    for name, prop in props.items():
        assert prop["x-env"] == f"{prefix}{name.upper()}"
        assert prop["x-flag"] == "--" + name.replace("_", "-")
        assert isinstance(prop["x-live"], bool)
        assert prop["description"], name
    assert {n for n, p in props.items() if p["x-live"]} == set(live_fields(cls))


def test_live_keys_are_the_documented_ones():
    assert set(DAEMON_LIVE) == DAEMON_LIVE_KEYS
    assert set(live_fields(PredictorConfig)) == PREDICTOR_LIVE_KEYS
    assert live_fields(ComputeConfig) == ()


def test_schema_carries_bounds_choices_and_defaults():
    props = config_schema(DaemonConfig, DAEMON_PREFIX)["properties"]
    assert props["io_threads"]["minimum"] == 1 and props["io_threads"]["maximum"] == 256
    assert "lru" in props["eviction_policy"]["enum"]
    assert props["device_budget_bytes"]["default"] == 1 << 30
    assert props["device_budget_max_bytes"]["x-live"] is False
    assert props["config_map_name"]["x-live"] is False


YAML_SPELLING = {"nan": ".nan", "NaN": ".NaN", "inf": ".inf", "-inf": "-.inf", "Infinity": "'Infinity'"}


@pytest.mark.parametrize("bad", ["nan", "NaN", "inf", "-inf", "Infinity"])
@pytest.mark.parametrize(
    ("cls", "prefix", "field", "required"),
    [
        (DaemonConfig, DAEMON_PREFIX, "hint_stale_s", {"store_dir": "/s"}),
        (PredictorConfig, PREDICTOR_PREFIX, "min_score", {}),
        (PredictorConfig, PREDICTOR_PREFIX, "live_request_ttl_s", {}),
        (ComputeConfig, COMPUTE_PREFIX, "acquire_timeout_s", {"store_dir": "/s"}),
    ],
)
def test_nan_and_infinity_are_refused_from_cli_env_and_file(tmp_path, bad, cls, prefix, field, required):
    with pytest.raises(InvalidArgument, match=rf"'{field}' = .* from command line is not a finite number"):
        load_config(cls, cli={**required, field: bad}, env={}, env_prefix=prefix)
    var = f"{prefix}{field.upper()}"
    with pytest.raises(InvalidArgument, match=rf"'{field}' = .* from env {var} is not a finite number"):
        load_config(cls, cli=required, env={var: bad}, env_prefix=prefix)
    path = tmp_path / "c.yaml"
    path.write_text(f"{field}: {YAML_SPELLING[bad]}\n")  # YAML's own NaN and infinity
    with pytest.raises(InvalidArgument, match=rf"'{field}' = .* from file {path} is not a finite number"):
        load_config(cls, cli=required, env={}, env_prefix=prefix, file=path)


def test_validate_refuses_nan_in_a_replaced_config():
    config = DaemonConfig(store_dir="/s")
    with pytest.raises(
        InvalidArgument, match=r"'hint_stale_s' = nan from UpdateConfig is not a finite number"
    ):
        validate(dataclasses.replace(config, hint_stale_s=math.nan), "UpdateConfig")


@pytest.mark.parametrize(
    ("cls", "prefix", "values", "message"),
    [
        (
            DaemonConfig,
            DAEMON_PREFIX,
            {"store_dir": "/s", "io_threads": "999"},
            r"'io_threads' = 999 is above its maximum 256 \(from command line; allowed: an integer in \[1, 256\]\)",
        ),
        (
            PredictorConfig,
            PREDICTOR_PREFIX,
            {"hint_top_n": "0"},
            r"'hint_top_n' = 0 is below its minimum 1 \(from command line; allowed: an integer in \[1, 4096\]\)",
        ),
        (
            PredictorConfig,
            PREDICTOR_PREFIX,
            {"eamc_capacity": "1.5"},
            r"'eamc_capacity' from command line: cannot read '1.5' as an integer in \[1, 1000000\]",
        ),
        (
            ComputeConfig,
            COMPUTE_PREFIX,
            {"store_dir": "/s", "shm_fast_path": "perhaps"},
            r"'shm_fast_path' from command line: cannot read 'perhaps' as a boolean",
        ),
    ],
)
def test_errors_name_field_source_and_allowed_range(cls, prefix, values, message):
    with pytest.raises(InvalidArgument, match=message):
        load_config(cls, cli=values, env={}, env_prefix=prefix)


def test_every_bad_field_is_named_at_once():
    with pytest.raises(InvalidArgument) as info:
        load_config(PredictorConfig, cli={"hint_top_n": "0", "match_top_n": "0"}, env={}, env_prefix="X_")
    assert "'hint_top_n'" in str(info.value) and "'match_top_n'" in str(info.value)


def test_numbers_in_yaml_are_read_for_string_fields(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("pod_name: 123\nprefetch: off\n")
    config = load_config(DaemonConfig, cli={"store_dir": "/s"}, env={}, env_prefix="X_", file=path)
    assert config.pod_name == "123" and config.prefetch is False


@pytest.mark.parametrize(("cls", "prefix", "module", "_req"), SERVICES)
def test_a_config_file_that_is_not_utf8_exits_2_naming_it(tmp_path, cls, prefix, module, _req):
    bad = tmp_path / "config.yaml"
    bad.write_bytes(b"log_level: INFO\n# caf\xe9 in latin-1\n")
    out = subprocess.run(
        [sys.executable, "-m", module, "--config-file", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr
    assert f"invalid configuration: config file {bad} is not UTF-8 text: byte 0xe9 at offset 21" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_charts_config_schema_is_generated_from_the_services():
    """helm/expertcache/values.schema.json's daemon/predictor/compute ``config`` schemas are what
    devtools/gen_values_schema.py makes of the services' --print-config-schema."""
    repo = Path(expertcache.__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "devtools.gen_values_schema", "--check"],
        capture_output=True,
        text=True,
        cwd=repo,
    )
    assert proc.returncode == 0, proc.stderr + "(regenerate it with `make values-schema`)"
