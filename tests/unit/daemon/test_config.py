"""Daemon configuration: precedence, constraints, and the start-up checks that need the store."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from cache_daemon.__main__ import main
from cache_daemon.budget import Budget
from cache_daemon.config import ENV_PREFIX, DaemonConfig
from cache_daemon.daemon import CacheDaemon
from cache_daemon.errors import BudgetTooSmall, StoreIncomplete
from expertcache.config_loader import load_config
from expertcache.errors import DataLoss, InvalidArgument
from expertcache.keys import ExpertKey
from tests.next_visit import write_next_visit_model
from tests.stores import write_store


def load(cli=None, env=None, file=None) -> DaemonConfig:
    return load_config(DaemonConfig, cli=cli or {}, env=env or {}, env_prefix=ENV_PREFIX, file=file)


TRANSPORT_COUNTS = (
    "max_concurrent_streams",
    "max_streams_per_address",
    "max_connections_per_address",
    "max_streams",
)


def test_every_field_is_documented_and_unit_suffixed():
    hints = typing.get_type_hints(DaemonConfig)
    for field in dataclasses.fields(DaemonConfig):
        assert field.default is not dataclasses.MISSING, field.name
        assert field.metadata.get("help"), field.name
        # A count of threads, of streams or connections (the transport's bounds) and a TCP port
        # have no unit.
        counts = ("io_threads", "metrics_port", *TRANSPORT_COUNTS)
        if hints[field.name] in (int, float) and field.name not in counts:
            # Units: bytes, seconds, tokens, layers; a probability is dimensionless, in [0, 1].
            assert field.name.endswith(("_bytes", "_s", "_tokens", "_layers", "_probability")), field.name


def test_defaults_and_precedence(tmp_path):
    config_file = tmp_path / "daemon.yaml"
    config_file.write_text(
        "store-dir: /from/file\nio_threads: 2\nhost_budget_bytes: 1000\nlog_level: debug\n"
    )
    config = load(
        cli={"store_dir": "/from/cli"},
        env={f"{ENV_PREFIX}IO_THREADS": "3", "IO_THREADS": "9"},
        file=config_file,
    )
    assert config.store_dir == "/from/cli"  # CLI > file
    assert config.io_threads == 3  # env > file; unprefixed env ignored
    assert config.host_budget_bytes == 1000  # file > default
    assert config.log_level == "DEBUG"
    assert config.device == "auto"
    assert config.eviction_policy == "activation-aware" and config.prefetch is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.io_threads = 5  # type: ignore[misc]


def test_unknown_field_in_config_file(tmp_path):
    config_file = tmp_path / "daemon.yaml"
    config_file.write_text("store_dir: /s\ndevice_budget: 5\n")
    with pytest.raises(
        InvalidArgument, match=r"unknown field 'device_budget'; known fields: .*device_budget_bytes"
    ):
        load(file=config_file)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"device_budget_bytes": "-1"}, r"'device_budget_bytes' = -1 is below its minimum 1"),
        ({"host_budget_bytes": -4096}, r"'host_budget_bytes' = -4096 is below its minimum 0"),
        ({"io_threads": 0}, r"'io_threads' = 0 is below its minimum 1"),
        ({"store_chunk_bytes": 2048}, r"'store_chunk_bytes' = 2048 is below its minimum 4096"),
        (
            {"store_chunk_bytes": 4096 * 64 + 512},
            r"'store_chunk_bytes' = 262656 is not a multiple of 4096 \(O_DIRECT reads are aligned to it\)",
        ),
        ({"acquire_timeout_s": "-0.5"}, r"'acquire_timeout_s' = -0.5 is below its minimum"),
        ({"device": "tpu"}, r"'device' = 'tpu' is not one of auto, cpu, cuda, cuda:<ordinal>"),
        ({"device": "cpu:1"}, r"'device' = 'cpu:1' is not one of auto, cpu, cuda, cuda:<ordinal>"),
        ({"device": "cuda:"}, r"'device' = 'cuda:' is not one of auto, cpu, cuda, cuda:<ordinal>"),
        (
            {"eviction_policy": "fifo"},
            r"'eviction_policy' = 'fifo' is not one of activation-aware, lfu, lru, moe-infinity \(",
        ),
        (  # the replay's references need the future: a daemon is not offered them
            {"eviction_policy": "belady"},
            r"'eviction_policy' = 'belady' is not one of activation-aware, lfu, lru, moe-infinity \(",
        ),
        (
            {"eviction_policy": "oracle-next-token"},
            r"'eviction_policy' = 'oracle-next-token' is not one of activation-aware, lfu, lru, moe-infinity \(",
        ),
        ({"max_inflight_bytes": "-1"}, r"'max_inflight_bytes' = -1 is below its minimum 0"),
        ({"prefetch": "maybe"}, r"'prefetch' from command line: cannot read 'maybe'"),
        (
            {"socket_path": "/run/" + "x" * 110},
            r"'socket_path' is 115 bytes long; it may be at most 97 bytes \(unix socket paths are limited to 105",
        ),
        ({"device_budget_bytes": "1GiB"}, r"'device_budget_bytes' from command line: cannot read '1GiB'"),
    ],
)
def test_bad_values_name_the_field(values, message):
    with pytest.raises(InvalidArgument, match=message):
        load(cli={"store_dir": "/s", **values})


@pytest.mark.parametrize("device", ["cuda:1", "cuda:GPU-5e0c1a2b-0000-1111-2222-333344445555"])
def test_a_gpu_can_be_named_by_ordinal_or_uuid(device):
    assert load(cli={"store_dir": "/s", "device": device}).device == device


def test_bad_env_value_names_the_variable():
    with pytest.raises(
        InvalidArgument, match=r"'host_budget_bytes' from env EXPERTCACHE_DAEMON_HOST_BUDGET_BYTES"
    ):
        load(cli={"store_dir": "/s"}, env={f"{ENV_PREFIX}HOST_BUDGET_BYTES": "lots"})


def test_store_dir_is_required():
    with pytest.raises(
        InvalidArgument, match=r"'store_dir' is required \(--store-dir or EXPERTCACHE_DAEMON_STORE_DIR\)"
    ):
        load()


def daemon_config(store: Path, tmp_path: Path, **overrides) -> DaemonConfig:
    values = {
        "store_dir": str(store),
        "socket_path": str(tmp_path / "d.sock"),
        "device_budget_bytes": 2 * 4096,
        "device": "cpu",
        **overrides,
    }
    return load(cli=values)


def test_budget_below_one_blob(tmp_path):
    store = tmp_path / "store"
    write_store(store)
    with pytest.raises(
        BudgetTooSmall,
        match=r"'device_budget_bytes' = 4000 is smaller than one expert blob \(blob_bytes=4096\)",
    ):
        CacheDaemon.start(daemon_config(store, tmp_path, device_budget_bytes=4000))
    with pytest.raises(BudgetTooSmall, match=r"'host_budget_bytes' = 100 is smaller than one expert blob"):
        CacheDaemon.start(daemon_config(store, tmp_path, host_budget_bytes=100))
    assert not list(tmp_path.glob("d.sock*"))  # nothing left behind


def test_budgets_larger_than_the_model_are_capped(tmp_path):
    store = tmp_path / "store"
    manifest = write_store(store)
    daemon = CacheDaemon.start(
        daemon_config(store, tmp_path, device_budget_bytes=1 << 30, host_budget_bytes=1 << 30)
    )
    try:
        assert daemon.arena.num_slots == manifest.num_blobs
        assert daemon.host.num_slots == manifest.num_blobs
        assert daemon.arena.size_bytes == manifest.num_blobs * manifest.blob_bytes
    finally:
        daemon.close()


def test_store_reads_are_issued_in_the_configured_chunks(tmp_path):
    store = tmp_path / "store"
    write_store(store)
    for chunk, want in ((None, 1 << 20), (8192, 8192)):
        extra = {} if chunk is None else {"store_chunk_bytes": chunk}
        daemon = CacheDaemon.start(daemon_config(store, tmp_path, **extra))
        try:
            assert daemon.store.chunk_bytes == want
        finally:
            daemon.close()


def test_missing_or_incomplete_store(tmp_path):
    with pytest.raises(DataLoss, match=r"manifest.json does not exist: .* is not a complete expert store"):
        CacheDaemon.start(daemon_config(tmp_path / "nowhere", tmp_path))
    store = tmp_path / "store"
    manifest = write_store(store)
    (store / manifest.layer_files[3]).unlink()
    with pytest.raises(StoreIncomplete, match="layer_0003.bin for layer 3 is missing"):
        CacheDaemon.start(daemon_config(store, tmp_path))


def test_main_exits_2_with_a_clear_message(tmp_path, capsys, caplog):
    store = tmp_path / "store"
    write_store(store)
    common = [
        "--store-dir",
        str(store),
        "--socket-path",
        str(tmp_path / "d.sock"),
    ]
    assert main([*common, "--device-budget-bytes", "4095"]) == 2
    assert "'device_budget_bytes' = 4095 is smaller than one expert blob (blob_bytes=4096)" in caplog.text
    assert main([*common, "--device-budget-bytes", "-3"]) == 2
    assert "'device_budget_bytes' = -3 is below its minimum 1" in capsys.readouterr().err
    assert not (tmp_path / "d.sock").exists()


def test_live_update_applies_whole_or_not_at_all(tmp_path):
    store = tmp_path / "store"
    write_store(store)
    daemon = CacheDaemon.start(daemon_config(store, tmp_path, device_budget_bytes=3 * 4096))
    try:
        assert daemon.config.eviction_policy == "activation-aware" and daemon.residency.prefetch_enabled
        update = daemon.update_config(
            {"eviction_policy": "moe-infinity", "prefetch": False, "hint_ttl_tokens": 5, "hint_stale_s": 2.0}
        )
        assert update.changed == ("eviction_policy", "prefetch", "hint_ttl_tokens", "hint_stale_s")
        assert daemon.residency.policy.name == "moe-infinity" and not daemon.residency.prefetch_enabled
        assert daemon.residency.signals.config.hint_ttl_tokens == 5 and daemon.hints.stale_after_s == 2.0
        assert daemon.stats().config == update.config
        before = daemon.config
        with pytest.raises(
            InvalidArgument,
            match=r"unknown config field 'device_budget'; live fields: device_budget_bytes, host_budget_bytes, eviction_policy",
        ):
            daemon.update_config({"prefetch": True, "device_budget": 5})
        with pytest.raises(InvalidArgument, match=r"'max_inflight_bytes' = -4 is below its minimum 0"):
            daemon.update_config({"prefetch": True, "max_inflight_bytes": -4})
        assert daemon.config is before and not daemon.residency.prefetch_enabled
        # A reload (SIGHUP) adopts the live fields of the config loaded again ...
        reloaded = daemon.reload(
            dataclasses.replace(before, eviction_policy="lfu", max_inflight_bytes=1 << 20)
        )
        assert reloaded.changed == ("eviction_policy", "max_inflight_bytes")
        assert daemon.residency.stats().inflight_bytes == 0 and daemon.residency.policy.name == "lfu"
        # ... and leaves a changed restart-only field unapplied (logged as a warning).
        reloaded = daemon.reload(dataclasses.replace(daemon.config, io_threads=7, prefetch=True))
        assert reloaded.changed == ("prefetch",)
        assert daemon.config.io_threads == before.io_threads and daemon.config.prefetch
    finally:
        daemon.close()


def test_live_budgets_shrink_and_grow_within_their_ceilings(tmp_path):
    store = tmp_path / "store"
    write_store(store)  # 12 blobs of 4 KiB
    daemon = CacheDaemon.start(
        daemon_config(
            store,
            tmp_path,
            device_budget_bytes=4 * 4096,
            device_budget_max_bytes=8 * 4096,
            host_budget_bytes=2 * 4096,
            host_budget_max_bytes=4 * 4096,
            prefetch=False,  # residency changes only through the acquires below
        )
    )
    try:
        assert (daemon.arena.num_slots, daemon.residency.num_slots) == (8, 4)
        assert (daemon.host.num_slots, daemon.host.limit) == (4, 2)
        session = daemon.residency.open_session("t")
        keys = [(1, e) for e in range(4)]
        for layer, expert in keys:
            list(daemon.residency.acquire(session, layer, [expert]))
            daemon.residency.release(session, [ExpertKey(layer, expert)])
        assert daemon.residency.stats().resident == 4
        # Shrink: two evicted now, two kept.
        update = daemon.update_config({"device_budget_bytes": 2 * 4096, "host_budget_bytes": 4096})
        assert update.changed == ("device_budget_bytes", "host_budget_bytes")
        assert daemon.residency.stats().resident == 2 and daemon.residency.num_slots == 2
        assert daemon.host.limit == 1 and daemon.host.resident_count() <= 1
        # Compute sized its waves by the arena (8 slots): a wave wider than the budget is still
        # admitted (demand beats the budget), and the next admission evicts back below it.
        wide = [ExpertKey(3, e) for e in range(4)]
        assert len(list(daemon.residency.acquire(session, 3, [k.expert for k in wide]))) == 4
        daemon.residency.release(session, wide)
        assert daemon.residency.stats().resident == 4
        list(daemon.residency.acquire(session, 1, [5]))
        daemon.residency.release(session, [ExpertKey(1, 5)])
        assert daemon.residency.stats().resident == 2
        # Grow up to the ceiling: more stay resident.
        daemon.update_config({"device_budget_bytes": 8 * 4096})
        for layer in (1, 3):
            for expert in range(6):
                list(daemon.residency.acquire(session, layer, [expert]))
                daemon.residency.release(session, [ExpertKey(layer, expert)])
        assert daemon.residency.stats().resident == 8
        # Above the ceiling: refused naming both values, nothing changed.
        with pytest.raises(
            InvalidArgument,
            match=r"'device_budget_bytes' = 36864 is above its ceiling device_budget_max_bytes = 32768",
        ):
            daemon.update_config({"device_budget_bytes": 9 * 4096, "prefetch": True})
        with pytest.raises(
            InvalidArgument, match=r"'host_budget_bytes' = 100 is smaller than one expert blob"
        ):
            daemon.update_config({"host_budget_bytes": 100})
        assert daemon.residency.num_slots == 8 and not daemon.config.prefetch and daemon.host.limit == 1
        daemon.residency.close_session(session)
    finally:
        daemon.close()


def test_budget_knows_its_field_ceiling_and_slots():
    blob = 4096
    device = Budget.device(DaemonConfig(store_dir="/s", device_budget_bytes=10 * blob + 5))
    assert (device.name, device.ceiling_name, device.ceiling) == (
        "device_budget_bytes",
        "device_budget_max_bytes",
        10 * blob + 5,  # 0 = the starting budget is the ceiling
    )
    assert device.slots(blob) == 10 and device.slots(blob, cap=4) == 4
    device.resized(10 * blob).check_ceiling()
    with pytest.raises(InvalidArgument, match=r"'device_budget_bytes' = 45056 is above its ceiling"):
        device.resized(11 * blob).check_ceiling()
    with pytest.raises(
        BudgetTooSmall,
        match=r"'device_budget_bytes' = 4095 is smaller than one expert blob \(blob_bytes=4096\): "
        r"set device_budget_bytes to at least 4096",
    ):
        device.resized(blob - 1).slots(blob)
    host = Budget.host(DaemonConfig(store_dir="/s", host_budget_max_bytes=8 * blob))
    assert (host.slots(blob), host.ceiling_slots(blob, cap=5)) == (0, 5)  # 0 bytes: no host tier
    with pytest.raises(
        BudgetTooSmall, match=r"'host_budget_max_bytes' = 100 is smaller than one expert blob"
    ):
        Budget.host(DaemonConfig(store_dir="/s", host_budget_max_bytes=100)).ceiling_slots(blob)


def test_budget_ceiling_below_the_budget_is_refused_at_start():
    with pytest.raises(
        InvalidArgument,
        match=r"'device_budget_bytes' = 8192 is above its ceiling device_budget_max_bytes = 4096",
    ):
        load(cli={"store_dir": "/s", "device_budget_bytes": 8192, "device_budget_max_bytes": 4096})


def test_starting_budget_is_the_ceiling_by_default(tmp_path):
    store = tmp_path / "store"
    write_store(store)
    daemon = CacheDaemon.start(daemon_config(store, tmp_path, device_budget_bytes=3 * 4096))
    try:
        assert daemon.arena.num_slots == 3
        daemon.update_config({"device_budget_bytes": 2 * 4096})
        daemon.update_config({"device_budget_bytes": 3 * 4096})  # back up to the start: allowed
        with pytest.raises(
            InvalidArgument,
            match=r"'device_budget_bytes' = 16384 is above its ceiling device_budget_max_bytes = 12288",
        ):
            daemon.update_config({"device_budget_bytes": 4 * 4096})
        with pytest.raises(InvalidArgument, match=r"'host_budget_bytes' = 4096 is above its ceiling"):
            daemon.update_config({"host_budget_bytes": 4096})  # no host tier was allocated
    finally:
        daemon.close()


def test_a_demand_under_a_shrunk_budget_is_not_held_up_by_pins(tmp_path):
    """Budget 1 slot, one expert pinned by the same stream: a 1-expert demand would wait forever
    for that pin inside the budget; it takes an arena slot beyond it instead."""
    store = tmp_path / "store"
    write_store(store)
    daemon = CacheDaemon.start(
        daemon_config(
            store, tmp_path, device_budget_bytes=4 * 4096, device_budget_max_bytes=4 * 4096, prefetch=False
        )
    )
    try:
        session = daemon.residency.open_session("t")
        list(daemon.residency.acquire(session, 1, [0]))  # pinned, kept
        daemon.update_config({"device_budget_bytes": 4096})
        got = list(daemon.residency.acquire(session, 1, [1], timeout_s=2.0))
        assert [r.key for r in got] == [ExpertKey(1, 1)]
        assert daemon.residency.stats().resident == 2  # one over the budget while both are pinned
        daemon.residency.release(session, [ExpertKey(1, 0), ExpertKey(1, 1)])
        list(daemon.residency.acquire(session, 3, [2]))
        daemon.residency.release(session, [ExpertKey(3, 2)])
        assert daemon.residency.stats().resident == 1  # back within the budget
        daemon.residency.close_session(session)
    finally:
        daemon.close()


def test_the_next_visit_model_is_loaded_at_start(tmp_path):
    store = tmp_path / "store"
    write_store(store)  # MoE layers 1 and 3, 6 experts
    model = write_next_visit_model(tmp_path / "nv.safetensors", 2, 6)
    daemon = CacheDaemon.start(daemon_config(store, tmp_path, next_visit_model=str(model)))
    try:
        signals = daemon.residency.signals
        assert signals.next_visit_model is not None and signals.next_visit_model.num_layers == 2
        signals.observe(3, [1, 4], 0)  # decoder layer 3 is the model's MoE layer 1
        p = signals.use_probability()[3 * 6 : 4 * 6]
        assert ((p > 0.0) & (p < 1.0)).all()  # the model's logistic estimate, not the history's
    finally:
        daemon.close()


def test_a_next_visit_model_that_does_not_fit_stops_the_start(tmp_path, caplog):
    store = tmp_path / "store"
    write_store(store)
    wrong = write_next_visit_model(tmp_path / "wrong.safetensors", 3, 6)
    with pytest.raises(
        InvalidArgument,
        match=r"config field 'next_visit_model' = '.*wrong.safetensors': next-visit model is for 3 MoE layers "
        r"x 6 experts, the model served has 2 x 6",
    ):
        CacheDaemon.start(daemon_config(store, tmp_path, next_visit_model=str(wrong)))
    with pytest.raises(
        InvalidArgument,
        match=r"config field 'next_visit_model': next-visit model .*missing.safetensors: No such file",
    ):
        CacheDaemon.start(
            daemon_config(store, tmp_path, next_visit_model=str(tmp_path / "missing.safetensors"))
        )
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"{}" * 10)
    args = ["--store-dir", str(store), "--socket-path", str(tmp_path / "d.sock")]
    assert main([*args, "--device", "cpu", "--next-visit-model", str(garbage)]) == 2
    assert "next-visit model" in caplog.text and "garbage.safetensors: not a safetensors file" in caplog.text
    assert not list(tmp_path.glob("d.sock*"))  # nothing left behind
