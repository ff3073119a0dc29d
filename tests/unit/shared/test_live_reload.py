"""The pieces of live reload: which changes apply, the file watch on a ConfigMap-like directory,
the reload thread, and the predictor adopting its live keys."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time

import numpy as np

from expertcache.live_config import ConfigFileWatcher, LiveConfig, LiveReloader, live_changes
from predictor_svc.config import ENV_PREFIX, PredictorConfig
from predictor_svc.service import PredictorService
from predictor_svc.store import EmbeddedStore
from tests import waiting

wait_for = functools.partial(waiting.wait_for, timeout_s=10.0)


def test_live_changes_keep_live_keys_and_warn_on_the_rest(caplog):
    old = PredictorConfig()
    new = dataclasses.replace(old, eamc_capacity=9, grpc_max_workers=8, min_score=0.25)
    with caplog.at_level(logging.WARNING):
        changes = live_changes(PredictorConfig, old, new, "file /c/predictor.yaml")
    assert changes == {"eamc_capacity": 9, "min_score": 0.25}
    assert "config field 'grpc_max_workers' changed in file /c/predictor.yaml (32 -> 8)" in caplog.text
    assert live_changes(PredictorConfig, old, old, "x") == {}


def test_predictor_reload_applies_live_keys_to_running_models():
    service = PredictorService(PredictorConfig(), EmbeddedStore(), background=False)
    try:
        service.register_model("m", 2, 4, 1)
        model = service.catalog.get("m")
        assert model.eamc.capacity == 512
        fresh = dataclasses.replace(
            service.config, eamc_capacity=3, match_top_n=2, sync_interval_s=0.5, subscriber_queue_requests=9
        )
        changed = service.reload(fresh, "test")
        assert changed == ("eamc_capacity", "match_top_n", "sync_interval_s")
        assert model.eamc.capacity == 3 and service.config.sync_interval_s == 0.5
        assert service.config.subscriber_queue_requests == 256  # restart-only: not applied
        assert service.reload(fresh, "test") == ()  # nothing new
    finally:
        service.close()


def test_reloader_runs_each_trigger_on_its_own_thread():
    seen: list[tuple[str, object, str]] = []
    done = threading.Event()

    def reload(origin, data):
        seen.append((origin, data, threading.current_thread().name))
        if origin == "boom":
            raise RuntimeError("a bug in a reload")
        if len(seen) == 3:
            done.set()

    reloader = LiveReloader(reload)
    try:
        reloader.trigger("boom")  # an exception does not end the thread
        reloader.trigger("SIGHUP")
        reloader.trigger("ConfigMap ns/c key k", "a: 1\n")
        assert done.wait(5)
        assert [(o, d) for o, d, _t in seen] == [
            ("boom", None),
            ("SIGHUP", None),
            ("ConfigMap ns/c key k", "a: 1\n"),
        ]
        assert {t for *_x, t in seen} == {"config-reload"}
    finally:
        reloader.close()


def test_file_watcher_sees_a_symlink_swap_and_ignores_other_files(tmp_path):
    (tmp_path / "..v1").mkdir()
    (tmp_path / "..v1" / "c.yaml").write_text("a: 1\n")
    os.symlink("..v1", tmp_path / "..data")
    os.symlink("..data/c.yaml", tmp_path / "c.yaml")
    changes = []
    watcher = ConfigFileWatcher(tmp_path / "c.yaml", lambda: changes.append(1))
    try:
        (tmp_path / "other.yaml").write_text("unrelated\n")  # same directory, not our file
        (tmp_path / "..v2").mkdir()
        (tmp_path / "..v2" / "c.yaml").write_text("a: 2\n")
        os.symlink("..v2", tmp_path / "..data_tmp")
        os.rename(tmp_path / "..data_tmp", tmp_path / "..data")
        wait_for(lambda: changes == [1], "the swap")
        # The same bytes again (a resync by the kubelet) are no change.
        (tmp_path / "..v3").mkdir()
        (tmp_path / "..v3" / "c.yaml").write_text("a: 2\n")
        os.symlink("..v3", tmp_path / "..data_tmp")
        os.rename(tmp_path / "..data_tmp", tmp_path / "..data")
        (tmp_path / "marker").write_text("x")
        (tmp_path / "..v2" / "c.yaml").write_text("a: 3\n")  # no longer the file: ignored
        # A real change afterwards is the second and last call: none of the above counted.
        (tmp_path / "..v4").mkdir()
        (tmp_path / "..v4" / "c.yaml").write_text("a: 4\n")
        os.symlink("..v4", tmp_path / "..data_tmp")
        os.rename(tmp_path / "..data_tmp", tmp_path / "..data")
        wait_for(lambda: len(changes) >= 2, "the second swap")
    finally:
        watcher.close()
    assert changes == [1, 1]


def test_live_config_refuses_a_bad_file_and_keeps_applying_good_ones(tmp_path, caplog):
    path = tmp_path / "predictor.yaml"
    path.write_text("eamc_capacity: 5\n")
    applied: list[PredictorConfig] = []
    live = LiveConfig(
        PredictorConfig,
        cli={},
        env_prefix=ENV_PREFIX + "UNSET_",
        config_file=str(path),
        apply=lambda fresh, origin: applied.append(fresh),
    )
    try:
        with caplog.at_level(logging.INFO):
            path.write_text("eamc_capacity: 0\n")
            wait_for(lambda: "refused, the running config stays" in caplog.text, "the refusal")
            assert (
                f"file {path}" in caplog.text and "'eamc_capacity' = 0 is below its minimum 1" in caplog.text
            )
            assert applied == []
            path.write_text("eamc_capacity: 6\nmin_score: .inf\n")
            wait_for(lambda: "is not a finite number" in caplog.text, "the second refusal")
            path.write_text("eamc_capacity: 6\n")
            wait_for(lambda: applied, "the good edit")
            assert applied[-1].eamc_capacity == 6
            live.trigger("SIGHUP")  # same file, forced
            wait_for(lambda: len(applied) == 2, "the SIGHUP reload")
    finally:
        live.close()
    assert np.isfinite(applied[-1].min_score) and applied[-1].eamc_capacity == 6


class _CountingWatcher(ConfigFileWatcher):
    reads = 0

    def _read(self):
        self.reads += 1
        return super()._read()


def test_file_watcher_is_not_woken_by_a_log_written_next_to_the_config(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("a: 1\n")
    changes = []
    watcher = _CountingWatcher(config, lambda: changes.append(1))
    try:
        log = tmp_path / "compute.log"
        for i in range(6):  # each write a separate batch (watchfiles debounces 200 ms)
            with open(log, "a") as f:
                f.write(f"line {i}\n")
            time.sleep(0.3)
        (tmp_path / ".c.yaml.swp").write_text("editor state")
        time.sleep(0.3)
        assert watcher.reads == 1  # the read at start only
        config.write_text("a: 2\n")
        wait_for(lambda: changes == [1], "the edit")
    finally:
        watcher.close()
