"""Live tuning through the mounted ConfigMap file: real daemon and predictor processes whose
``--config-file`` is edited the way the kubelet does it (a new timestamped directory, then the
``..data`` symlink swapped over the old one), with no signal. The new budgets and policy take
effect with no restart while Demand streams keep acquiring; an invalid edit is refused whole and
the old values stay; a changed restart-only key is logged and left unapplied."""

from __future__ import annotations

import functools
import json
import signal
import threading

import grpc
import pytest
from moe.cache.v1 import cache_pb2, cache_pb2_grpc
from moe.inference.v1 import inference_pb2, inference_pb2_grpc

from devtools.launch import start_compute, start_daemon
from tests import waiting
from tests.daemons import BLOB, Daemon, DemandStream, start_live_daemon, tiers
from tests.kubelet import KubeletVolume
from tests.predictors import SHAPE, request, start_predictor, stats, stub
from tests.stores import write_store

pytestmark = pytest.mark.integration

wait_for = functools.partial(waiting.wait_for, poll_s=0.02, timeout_s=15.0)
# The fixture's starting budgets: an edit that leaves a key out sets it back to its default.
BUDGETS = f"device_budget_bytes: {3 * BLOB}\nhost_budget_bytes: {2 * BLOB}\n"


class Streamer:
    """A Demand stream acquiring and releasing experts in a loop (compute generating), recording
    any failure."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.errors: list[BaseException] = []
        self.acquires = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        stream = DemandStream(self.daemon.stub)
        ticket = 0
        try:
            while not self._stop.is_set():
                for layer in (1, 3):
                    experts = [ticket % 6, (ticket + 1) % 6]
                    ticket += 1
                    readies, done = stream.acquire(ticket, layer, experts)
                    assert done.ticket == ticket
                    assert sorted(r.expert.expert for r in readies) == sorted(experts)
                    for r in readies:  # every expert is read where the daemon says it is
                        assert self.daemon.slot_bytes(r.slot) == self.daemon.blob(layer, r.expert.expert)
                    stream.release(layer, experts)
                    self.acquires += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)
        finally:
            stream.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def device(daemon: Daemon) -> cache_pb2.TierStats:
    return tiers(daemon.stats())[cache_pb2.TIER_DEVICE]


def host(daemon: Daemon) -> cache_pb2.TierStats:
    return tiers(daemon.stats())[cache_pb2.TIER_HOST]


@pytest.fixture
def live_daemon(tmp_path):
    store = tmp_path / "store"
    manifest = write_store(store)  # 2 MoE layers x 6 experts of 4 KiB
    # The budgets come from the file (a flag or env variable would override it: CLI > env > file).
    volume = KubeletVolume(
        tmp_path / "config",
        "daemon.yaml",
        f"eviction_policy: lru\ndevice_budget_bytes: {3 * BLOB}\nhost_budget_bytes: {2 * BLOB}\n",
    )
    proc = start_live_daemon(
        store,
        volume.path,
        tmp_path,
        "--device-budget-max-bytes",
        str(8 * BLOB),
        "--host-budget-max-bytes",
        str(6 * BLOB),
    )
    d = Daemon(proc, store, manifest)
    yield d, volume
    d.close()
    assert proc.stop() == 0, proc.log()


def test_kubelet_edit_retunes_budgets_and_policy_while_streaming(live_daemon):
    d, volume = live_daemon
    pid = d.proc.popen.pid
    assert d.stats().config.eviction_policy == "lru"
    assert (device(d).capacity_slots, host(d).capacity_slots) == (3, 2)
    streamer = Streamer(d)
    try:
        wait_for(lambda: streamer.acquires >= 5 or streamer.errors, "acquires before the edit")
        # Grow both budgets and switch the policy: no signal, only the swapped symlink.
        volume.write(
            f"eviction_policy: lfu\ndevice_budget_bytes: {8 * BLOB}\nhost_budget_bytes: {6 * BLOB}\n"
        )
        wait_for(lambda: d.stats().config.eviction_policy == "lfu", "the new policy")
        wait_for(lambda: device(d).capacity_slots == 8, "the grown device budget")
        # The host tier is resized after the device tier, in the same update: GetStats may come between.
        wait_for(lambda: host(d).capacity_slots == 6, "the grown host budget")
        seen = streamer.acquires
        wait_for(lambda: streamer.acquires >= seen + 10 or streamer.errors, "acquires after growing")
        wait_for(lambda: device(d).resident > 3, "more experts resident than the old budget held")
        # Shrink: the least valuable experts go, the rest stay resident.
        volume.write(f"eviction_policy: lfu\ndevice_budget_bytes: {2 * BLOB}\nhost_budget_bytes: {BLOB}\n")
        wait_for(lambda: device(d).capacity_slots == 2, "the shrunk device budget")
        wait_for(lambda: device(d).resident <= 2, "residents within the shrunk budget")
        wait_for(lambda: host(d).capacity_slots == 1, "the shrunk host budget")
        wait_for(lambda: host(d).resident <= 1, "the host tier within its shrunk budget")
        seen = streamer.acquires
        wait_for(lambda: streamer.acquires >= seen + 10 or streamer.errors, "acquires after shrinking")
    finally:
        streamer.stop()
    assert not streamer.errors, streamer.errors
    # Once the stream is gone, the last experts it used stay resident: exactly the budget.
    assert device(d).resident == 2 and d.stats().pinned == 0
    assert d.proc.popen.pid == pid and d.proc.popen.poll() is None  # never restarted
    assert "config reloaded from file" in d.proc.log()


def log_record(line: str) -> tuple[str, str]:
    """(level, message) of a service's log line: JSON (``log_format`` auto off a terminal) or text."""
    if line.startswith("{"):
        record = json.loads(line)
        return record["level"], record["message"]
    level = next((w for w in ("ERROR", "WARNING", "INFO", "DEBUG") if f" {w} " in line), "")
    return level, line


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (
            f"device_budget_bytes: {100 * BLOB}\n",
            f"is above its ceiling device_budget_max_bytes = {8 * BLOB}",
        ),
        (
            f"device_budget_bytes: {3 * BLOB}\nhost_budget_bytes: {7 * BLOB}\n",
            f"is above its ceiling host_budget_max_bytes = {6 * BLOB}",
        ),
        ("eviction_policy: lfu\nhint_stale_s: .nan\n", "'hint_stale_s' = nan from file"),
        ("eviction_policy: fifo\n", "'eviction_policy' = 'fifo' is not one of"),
        ("eviction_policy: [lfu\n", "config file"),
        ("eviction_policy: lfu\ndevice_budget: 5\n", "unknown field 'device_budget'"),
        ("eviction_policy: belady\n", "'eviction_policy' = 'belady' is not one of"),
    ],
)
def test_invalid_edit_is_refused_whole_and_the_old_config_stays(live_daemon, text, reason):
    d, volume = live_daemon
    before = d.stats()
    volume.write(text)
    wait_for(lambda: "refused, the running config stays" in d.proc.log(), "the refusal in the log")
    log = d.proc.log()
    line = next(x for x in log.splitlines() if "refused, the running config stays" in x)
    level, message = log_record(line)
    assert level == "ERROR" and str(volume.path) in message and reason in message, line
    after = d.stats()
    assert after.config == before.config
    assert [t.capacity_slots for t in after.tiers] == [t.capacity_slots for t in before.tiers]
    # The next valid edit still applies.
    volume.write("eviction_policy: moe-infinity\n" + BUDGETS)
    wait_for(lambda: d.stats().config.eviction_policy == "moe-infinity", "a valid edit after a refused one")


def test_restart_only_key_is_logged_and_not_applied(live_daemon):
    d, volume = live_daemon
    volume.write("eviction_policy: lfu\nio_threads: 9\nprefetch: false\n" + BUDGETS)
    wait_for(lambda: d.stats().config.eviction_policy == "lfu", "the live keys")
    assert not d.stats().config.prefetch
    log = d.proc.log()
    assert "WARNING" in log and "config field 'io_threads' changed in file" in log
    assert "not applied until the service restarts" in log


def test_a_next_visit_model_is_swapped_in_by_an_edit_while_streaming(live_daemon, tmp_path):
    from tests.next_visit import write_next_visit_model

    d, volume = live_daemon
    streamer = Streamer(d)
    try:
        model = write_next_visit_model(tmp_path / "nv-1.safetensors", 2, 6)  # 2 MoE layers x 6 experts
        volume.write(f"eviction_policy: activation-aware\nnext_visit_model: {model}\n" + BUDGETS)
        wait_for(lambda: d.stats().config.next_visit_model == str(model), "the model swapped in")
        assert f"next-visit model {model}: 2 MoE layers x 6 experts" in d.proc.log()
        # A model of another shape is refused whole: the policy edit beside it is not applied.
        wrong = write_next_visit_model(tmp_path / "nv-2.safetensors", 3, 6)
        volume.write(f"eviction_policy: lfu\nnext_visit_model: {wrong}\n" + BUDGETS)
        wait_for(
            lambda: "is for 3 MoE layers x 6 experts, the model served has 2 x 6" in d.proc.log(), "refusal"
        )
        after = d.stats().config
        assert after.next_visit_model == str(model) and after.eviction_policy == "activation-aware"
        volume.write("eviction_policy: activation-aware\n" + BUDGETS)  # back to the transitions
        wait_for(lambda: d.stats().config.next_visit_model == "", "the model dropped")
    finally:
        streamer.stop()
    assert not streamer.errors, streamer.errors
    assert streamer.acquires > 0


def test_a_file_key_overridden_by_a_flag_is_named(tmp_path):
    store = tmp_path / "store"
    write_store(store)
    volume = KubeletVolume(tmp_path / "config", "daemon.yaml", "eviction_policy: lru\n")
    extra = ["--config-file", str(volume.path)]
    proc = start_daemon(store, tmp_path, device="cpu", device_budget_bytes=3 * BLOB, extra=extra)
    try:
        volume.write(f"eviction_policy: lfu\ndevice_budget_bytes: {2 * BLOB}\n")
        wait_for(lambda: "is not applied: the command line sets it" in proc.log(), "the override warning")
        assert f"config key 'device_budget_bytes' = {2 * BLOB} in file {volume.path}" in proc.log()
    finally:
        assert proc.stop() == 0, proc.log()


def test_sighup_reloads_too(live_daemon):
    d, volume = live_daemon
    # Written in place under the symlink (no swap): the watch sees it; SIGHUP forces it anyway.
    (volume.root / "..data" / "daemon.yaml").write_text("eviction_policy: activation-aware\n" + BUDGETS)
    d.proc.popen.send_signal(signal.SIGHUP)
    wait_for(lambda: d.stats().config.eviction_policy == "activation-aware", "the SIGHUP reload")


# -- the predictor ---------------------------------------------------------------------------------
def test_predictor_applies_live_keys_and_refuses_a_bad_file(tmp_path):
    volume = KubeletVolume(tmp_path / "config", "predictor.yaml", "max_live_requests: 100\n")
    proc = start_predictor(tmp_path, "--model-shapes", SHAPE, "--config-file", str(volume.path))
    try:
        s = stub(proc)
        for i in range(3):  # three live requests, none finished
            s.Observe(request(f"live-{i}", 2, done=False), timeout=10)
        assert stats(proc).live_requests == 3
        # Live: fewer live requests tracked, a smaller EAMC, other hint settings.
        volume.write("max_live_requests: 1\neamc_capacity: 7\nhint_top_n: 2\nmin_score: 0.5\n")
        wait_for(lambda: "config updated from file" in proc.log(), "the predictor's reload")
        log = proc.log()
        for key in ("max_live_requests=1", "eamc_capacity=7", "hint_top_n=2", "min_score=0.5"):
            assert key in log, log
        s.Observe(request("live-3", 2, done=False), timeout=10)
        assert stats(proc).live_requests == 1  # the new bound took effect without a restart
        # Restart-only: logged, not applied.
        volume.write(
            "max_live_requests: 1\neamc_capacity: 7\nhint_top_n: 2\nmin_score: 0.5\ngrpc_max_workers: 3\n"
        )
        wait_for(lambda: "'grpc_max_workers' changed in file" in proc.log(), "the restart-only warning")
        # Invalid: refused whole (the valid key in the same edit is not applied either).
        volume.write("max_live_requests: 50\nmin_score: 1.5\n")
        wait_for(lambda: "refused, the running config stays" in proc.log(), "the refusal")
        assert "'min_score' = 1.5 is above its maximum 1.0" in proc.log()
        for i in range(3):
            s.Observe(request(f"more-{i}", 2, done=False), timeout=10)
        assert stats(proc).live_requests == 1  # max_live_requests is still 1
        # SIGHUP reloads the file (now valid again).
        (volume.root / "..data" / "predictor.yaml").write_text("max_live_requests: 2\n")
        proc.popen.send_signal(signal.SIGHUP)
        wait_for(lambda: "max_live_requests=2" in proc.log(), "the SIGHUP reload")
        for i in range(3):
            s.Observe(request(f"last-{i}", 2, done=False), timeout=10)
        assert stats(proc).live_requests == 2
    except grpc.RpcError as exc:  # pragma: no cover - shows the log
        raise AssertionError(f"{exc}\n{proc.log()}") from exc
    finally:
        assert proc.stop() == 0, proc.log()


# -- a real generation streaming through the edits -----------------------------------------------
def test_budget_and_policy_edits_while_a_generation_streams(tiny_store, tmp_path):
    """compute + daemon as real processes; the daemon's budgets and policy change through its
    mounted file while a Generate streams: no failed request, the same tokens as before the edits
    (greedy decoding: the cache never changes an answer), and no restart."""

    tiny = tiny_store("mixtral")
    blob, blobs = tiny.manifest.blob_bytes, tiny.manifest.num_blobs
    quarter = max(2, blobs // 4)
    volume = KubeletVolume(
        tmp_path / "config", "daemon.yaml", f"eviction_policy: lru\ndevice_budget_bytes: {quarter * blob}\n"
    )
    ceiling = ("--device-budget-max-bytes", str(blobs * blob))
    daemon = start_live_daemon(tiny.store, volume.path, tmp_path, *ceiling)
    compute = None
    try:
        compute = start_compute(tiny.store, daemon, tmp_path)
        channel = grpc.insecure_channel(compute.address)
        infer = inference_pb2_grpc.InferenceStub(channel)
        cache_stub = cache_pb2_grpc.ExpertCacheStub(grpc.insecure_channel(daemon.address))

        def device_slots() -> tuple[int, str]:
            s = cache_stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
            return tiers(s)[cache_pb2.TIER_DEVICE].capacity_slots, s.config.eviction_policy

        request = dict(token_ids=list(range(5, 30)), max_new_tokens=48, ignore_eos=True)
        reference = [
            r.token_id for r in infer.Generate(inference_pb2.GenerateRequest(**request), timeout=120)
        ]
        assert device_slots() == (quarter, "lru")
        got: list[int] = []
        for reply in infer.Generate(inference_pb2.GenerateRequest(**request), timeout=120):
            got.append(reply.token_id)
            if len(got) == 4:  # mid-stream: grow the budget, switch the policy
                volume.write(f"eviction_policy: lfu\ndevice_budget_bytes: {blobs * blob}\n")
                wait_for(lambda: device_slots() == (blobs, "lfu"), "grown budget and new policy")
            elif len(got) == 20:  # shrink below one layer's experts: waves overshoot, nothing fails
                volume.write(f"eviction_policy: activation-aware\ndevice_budget_bytes: {blob}\n")
                wait_for(lambda: device_slots() == (1, "activation-aware"), "shrunk budget")
        assert got == reference
        assert daemon.popen.poll() is None and compute.popen.poll() is None
        channel.close()
    finally:
        if compute is not None:
            assert compute.stop() == 0, compute.log()
        assert daemon.stop() == 0, daemon.log()
