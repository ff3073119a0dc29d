"""Eamc on a real redis-server: shared replicas, capacity under concurrency, restarts, outages."""

from __future__ import annotations

import multiprocessing
import threading
import time

import numpy as np
import pytest
import redis

from devtools.redis_server import RedisServer
from predictor_svc.eam import EamShape, decode_eam
from predictor_svc.eamc import Eamc
from predictor_svc.errors import StoreUnavailable
from predictor_svc.store import open_store
from predictor_svc.store.redis_store import RedisStore

SHAPE = EamShape(layers=6, experts=8, top_k=2)


def random_eam(rng: np.random.Generator, tokens: int = 10) -> np.ndarray:
    eam = np.zeros((SHAPE.layers, SHAPE.experts), dtype=np.uint32)
    prefs = rng.dirichlet(np.full(SHAPE.experts, 0.5), size=SHAPE.layers)
    for _ in range(tokens):
        for layer in range(SHAPE.layers):
            eam[layer, rng.choice(SHAPE.experts, 2, replace=False, p=prefs[layer])] += 1
    return eam


@pytest.fixture
def server(tmp_path):
    with RedisServer(tmp_path / "redis") as srv:
        yield srv


def test_two_replicas_share_one_eamc_incrementally(server):
    rng = np.random.default_rng(0)
    a = Eamc(open_store(server.url), "gpt", SHAPE, capacity=6)
    b = Eamc(RedisStore(server.url), "gpt", SHAPE, capacity=6)
    a.sync(), b.sync()
    eams = [random_eam(rng) for _ in range(6)]
    ids = [a.insert(e, 10) for e in eams[:3]] + [b.insert(e, 10) for e in eams[3:]]
    a.sync(), b.sync()
    assert sorted(a.ids()) == sorted(b.ids()) == sorted(ids)
    # at capacity: a near copy of eams[4] (inserted by b) replaces exactly that entry
    new_id = a.insert(eams[4] * 2 + 1, 21)
    assert b.sync() == 2  # one del, one put
    assert ids[4] not in b.ids() and new_id in b.ids() and b.entries == 6
    assert (
        a.counters.full_reloads == 1 and b.counters.full_reloads == 1
    )  # everything after the first load was incremental
    assert b.counters.incremental_syncs >= 2
    client = redis.Redis.from_url(server.url)
    assert client.hlen("expertcache:eamc:gpt:entries") == 6
    assert client.exists("expertcache:eamc:gpt:log")


def _process_worker(url: str, seed: int, n: int, capacity: int) -> None:
    rng = np.random.default_rng(seed)
    eamc = Eamc(RedisStore(url), "gpt", SHAPE, capacity)
    for _ in range(n):
        eamc.insert(random_eam(rng, tokens=4), 4)


def test_capacity_holds_under_concurrent_threads_and_processes(server):
    capacity = 8
    observer = Eamc(RedisStore(server.url), "gpt", SHAPE, capacity)
    observer.sync()
    client = redis.Redis.from_url(server.url)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_process_worker, args=(server.url, s, 12, capacity)) for s in range(3)]
    errors: list[BaseException] = []
    peak = [0]
    done = threading.Event()

    def thread_worker(seed):
        try:
            _process_worker(server.url, seed, 12, capacity)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], client.hlen("expertcache:eamc:gpt:entries"))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    threads = [threading.Thread(target=thread_worker, args=(100 + s,)) for s in range(3)]
    for p in procs:  # forked before any thread of ours starts
        p.start()
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    done.set()
    watcher.join()
    assert not errors
    assert peak[0] <= capacity
    entries = client.hgetall("expertcache:eamc:gpt:entries")
    assert len(entries) == capacity
    for blob in entries.values():
        decode_eam(blob, SHAPE)  # no torn entry
    assert int(client.get("expertcache:eamc:gpt:seq")) == 72 + (72 - capacity)  # puts + dels
    observer.sync()  # the incremental view equals the store
    assert sorted(observer.ids()) == sorted(k.decode() for k in entries)
    assert observer.counters.full_reloads == 1


def test_redis_restart_loses_no_entry(server):
    rng = np.random.default_rng(1)
    a = Eamc(RedisStore(server.url), "gpt", SHAPE, 20)
    ids = [a.insert(random_eam(rng), 10) for _ in range(7)]
    server.restart()  # append-only file replays every script
    fresh = Eamc(RedisStore(server.url), "gpt", SHAPE, 20)  # a predictor restart
    fresh.sync()
    assert sorted(fresh.ids()) == sorted(ids)
    a.insert(random_eam(rng), 10)  # the old replica carries on incrementally
    fresh.sync()
    assert fresh.entries == 8 and fresh.counters.full_reloads == 1 and a.counters.full_reloads == 1


def test_redis_down_raises_store_unavailable_and_index_keeps_answering(server):
    rng = np.random.default_rng(2)
    eamc = Eamc(RedisStore(server.url, socket_timeout_s=0.5), "gpt", SHAPE, 20)
    for _ in range(4):
        eamc.insert(random_eam(rng), 10)
    other = Eamc(RedisStore(server.url), "gpt", SHAPE, 20)
    query = random_eam(rng, 3)
    before = eamc.similarities(query)
    server.stop()
    with pytest.raises(StoreUnavailable, match=f"EAMC store redis at {server.url} unavailable") as info:
        eamc.insert(random_eam(rng), 10)
    assert info.value.grpc_code == "UNAVAILABLE"
    with pytest.raises(StoreUnavailable, match=r"unavailable \(changes\)"):
        eamc.sync()
    assert eamc.counters.store_errors == 2
    np.testing.assert_array_equal(eamc.similarities(query), before)  # still serving
    assert eamc.predict(query).shape == (6, 8)
    server.start()
    other.insert(random_eam(rng), 10)  # written while `eamc` was cut off
    assert eamc.sync() == 1 and eamc.entries == 5
    eamc.insert(random_eam(rng), 10)
    assert eamc.entries == 6 and eamc.counters.full_reloads == 1


def test_trimmed_change_log_forces_reload(server):
    rng = np.random.default_rng(3)
    a = Eamc(RedisStore(server.url, log_len=3), "gpt", SHAPE, 50)
    b = Eamc(RedisStore(server.url, log_len=3), "gpt", SHAPE, 50)
    b.sync()
    a.insert(random_eam(rng), 10)
    assert b.sync() == 1 and b.counters.full_reloads == 1
    for _ in range(5):
        a.insert(random_eam(rng), 10)
    b.sync()
    assert b.counters.full_reloads == 2 and sorted(b.ids()) == sorted(a.ids())
    client = redis.Redis.from_url(server.url)
    client.delete("expertcache:eamc:gpt:entries", "expertcache:eamc:gpt:seq", "expertcache:eamc:gpt:epoch")
    b.sync()  # collection wiped: the epoch changed, reload to empty
    assert b.counters.full_reloads == 3 and b.entries == 0


def test_unreachable_url_names_it():
    store = RedisStore("redis://127.0.0.1:1/0", socket_timeout_s=0.5)
    with pytest.raises(StoreUnavailable, match=r"redis at redis://127.0.0.1:1/0 unavailable \(load\)"):
        store.load("gpt")
    with pytest.raises(StoreUnavailable, match=r"unavailable \(count\)"):
        store.count("gpt")


def test_every_redis_round_trip_is_timed_for_the_metrics(server):
    from predictor_svc.config import PredictorConfig
    from predictor_svc.metrics import registry
    from predictor_svc.service import PredictorService

    store = RedisStore(server.url)
    service = PredictorService(PredictorConfig(redis_url=server.url), store, background=False)
    rng = np.random.default_rng(3)
    a = Eamc(store, "gpt", SHAPE, 20)
    a.insert(random_eam(rng), 10)
    a.sync()
    text = registry(service.metrics, service.gauge_stats).render()
    counts = {
        line.split('op="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("moe_predictor_store_round_trip_seconds_count{")
    }
    assert counts.get("insert", 0) >= 1 and counts.get("load", 0) >= 1, text
    server.stop()
    with pytest.raises(StoreUnavailable):
        store.count("gpt")
    failed = registry(service.metrics, service.gauge_stats).render()
    assert 'moe_predictor_store_round_trip_seconds_count{op="count"} 1.0' in failed  # failures are timed too
