"""``config_map_name``: the daemon and the predictor watch their ConfigMap through the Kubernetes
API with the real ``kubernetes`` client, here against ``FakeKubeApi`` (a real HTTP server on a
real socket speaking the list/watch JSON), reached through a kubeconfig. A change applies at
once; a refused change keeps the running config and posts a Warning Event on the ConfigMap."""

from __future__ import annotations

import functools
import json
import os

import pytest
from moe.cache.v1 import cache_pb2

from devtools.launch import free_port, start
from expertcache.k8s_watch import EVENT_REASON, ConfigMapWatcher
from tests import waiting
from tests.daemons import BLOB, Daemon, tiers
from tests.integration.fake_kube_api import FakeKubeApi
from tests.predictors import SHAPE, request, stats, stub
from tests.stores import write_store

pytestmark = pytest.mark.integration

NAMESPACE = "expertcache-test"
NAME = "expertcache-cache"
wait_for = functools.partial(waiting.wait_for, poll_s=0.02, timeout_s=20.0)


@pytest.fixture
def kube(tmp_path, monkeypatch):
    api = FakeKubeApi(NAMESPACE)
    config = api.kubeconfig(tmp_path / "kubeconfig")
    # Children inherit these: a kubeconfig instead of in-cluster credentials, and the namespace
    # the downward API would give.
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(config))
    monkeypatch.setenv("POD_NAMESPACE", NAMESPACE)
    yield api
    api.close()


def refusal_events(api: FakeKubeApi) -> list[dict]:
    return [e for e in api.events if e.get("reason") == EVENT_REASON]


def log_messages(proc) -> list[str]:
    """The messages of a service's log, JSON lines (``log_format`` auto off a terminal) or text."""
    out = []
    for line in proc.log().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line)["message"])
        else:
            out.append(line)
    return out


def test_predictor_follows_its_configmap_and_posts_an_event_when_refusing(kube, tmp_path):
    kube.set_configmap(
        NAME, {"predictor.yaml": "max_live_requests: 100\n", "daemon.yaml": "prefetch: false\n"}
    )
    address = f"127.0.0.1:{free_port()}"
    proc = start(
        "predictor_svc",
        [
            "--listen-address",
            address,
            "--model-shapes",
            SHAPE,
            "--config-map-name",
            NAME,
            "--embedded-path",
            str(tmp_path / "eamc.bin"),
        ],
        address,
        tmp_path / "predictor.log",
    )
    try:
        wait_for(lambda: kube.watchers(NAME) == 1, "the predictor's watch")
        s = stub(proc)
        for i in range(3):
            s.Observe(request(f"r{i}", 2, done=False), timeout=10)
        assert stats(proc).live_requests == 3
        kube.set_configmap(NAME, {"predictor.yaml": "max_live_requests: 1\nhint_top_n: 3\n"})
        origin = f"ConfigMap {NAMESPACE}/{NAME} key predictor.yaml"
        updated = f"config updated from {origin}: hint_top_n=3, max_live_requests=1"
        wait_for(lambda: any(m.endswith(updated) for m in log_messages(proc)), "the change")
        s.Observe(request("r3", 2, done=False), timeout=10)
        assert stats(proc).live_requests == 1
        assert not refusal_events(kube)
        # Invalid: refused whole, logged, and a Warning Event on the ConfigMap says why.
        kube.set_configmap(NAME, {"predictor.yaml": "max_live_requests: 50\nmin_score: 2\n"})
        wait_for(lambda: refusal_events(kube), "the Warning Event")
        event = refusal_events(kube)[0]
        assert event["type"] == "Warning"
        involved = event["involvedObject"]
        assert (involved["kind"], involved["name"], involved["namespace"]) == ("ConfigMap", NAME, NAMESPACE)
        assert involved["uid"] == kube.configmaps[NAME]["metadata"]["uid"]
        assert "'min_score' = 2 is above its maximum 1.0" in event["message"]
        assert event["source"]["component"] == "expertcache-predictor"
        assert "refused, the running config stays" in proc.log()
        for i in range(3):
            s.Observe(request(f"after-{i}", 2, done=False), timeout=10)
        assert stats(proc).live_requests == 1  # the old bound stays
        # A key missing from the ConfigMap applies nothing (logged).
        kube.set_configmap(NAME, {"daemon.yaml": "prefetch: true\n"})
        wait_for(lambda: "has no key 'predictor.yaml'" in proc.log(), "the missing-key warning")
    finally:
        assert proc.stop() == 0, proc.log()


def test_daemon_follows_its_configmap(kube, tmp_path):
    store = tmp_path / "store"
    manifest = write_store(store)
    first = f"eviction_policy: lru\ndevice_budget_bytes: {3 * BLOB}\n"
    kube.set_configmap(NAME, {"daemon.yaml": first})
    # The pod mounts the same ConfigMap as its --config-file; the kubelet refreshes that copy
    # only later (here: never), the API watch at once.
    mounted = tmp_path / "daemon.yaml"
    mounted.write_text(first)
    sock = tmp_path / "daemon.sock"
    args = ["--store-dir", str(store), "--socket-path", str(sock), "--device", "cpu"]
    args += ["--config-file", str(mounted)]
    args += ["--config-map-name", NAME, "--device-budget-max-bytes", str(6 * BLOB)]
    proc = start("cache_daemon", args, f"unix://{sock}", tmp_path / "daemon.log")
    d = Daemon(proc, store, manifest)
    try:
        wait_for(lambda: kube.watchers(NAME) == 1, "the daemon's watch")
        wait_for(lambda: d.stats().config.eviction_policy == "lru", "the initial ConfigMap")
        kube.set_configmap(NAME, {"daemon.yaml": f"eviction_policy: lfu\ndevice_budget_bytes: {5 * BLOB}\n"})
        wait_for(lambda: d.stats().config.eviction_policy == "lfu", "the new policy")
        wait_for(lambda: tiers(d.stats())[cache_pb2.TIER_DEVICE].capacity_slots == 5, "the new budget")
        kube.set_configmap(NAME, {"daemon.yaml": f"eviction_policy: lru\ndevice_budget_bytes: {9 * BLOB}\n"})
        # (refused: the ceiling is 6 blobs)
        wait_for(lambda: refusal_events(kube), "the Warning Event")
        message = refusal_events(kube)[0]["message"]
        assert (
            f"'device_budget_bytes' = {9 * BLOB} is above its ceiling device_budget_max_bytes = {6 * BLOB}"
            in message
        )
        assert d.stats().config.eviction_policy == "lfu"
        assert tiers(d.stats())[cache_pb2.TIER_DEVICE].capacity_slots == 5
    finally:
        d.close()
        assert proc.stop() == 0, proc.log()


def test_watch_resumes_after_the_server_ends_it(kube):
    """The API server ends every watch after timeoutSeconds (and on restarts): the watcher lists
    and watches again, and sees a change made in between."""
    kube.set_configmap(NAME, {"k": "a: 1\n"})
    seen: list[str] = []
    watcher = ConfigMapWatcher(NAME, "k", lambda _origin, text: seen.append(text))
    try:
        wait_for(lambda: seen == ["a: 1\n"] and kube.watchers(NAME) == 1, "the first list and watch")
        # End the open watch from the server side, then change the ConfigMap.
        kube.set_configmap(NAME, {"k": "a: 2\n"})
        wait_for(lambda: seen[-1:] == ["a: 2\n"], "a change seen by the watch")
        with kube._lock:
            for _name, q in kube._watchers:
                q.put(None)
        wait_for(
            lambda: (
                kube.requests.count(
                    f"GET /api/v1/namespaces/{NAMESPACE}/configmaps?fieldSelector=metadata.name%3D{NAME}"
                )
                >= 2
            ),
            "a relist",
        )
        kube.set_configmap(NAME, {"k": "a: 3\n"})
        wait_for(lambda: seen[-1:] == ["a: 3\n"], "a change after the watch was renewed")
        assert seen == ["a: 1\n", "a: 2\n", "a: 3\n"]  # each text once, in order
    finally:
        watcher.close()


def test_forbidden_is_an_error_naming_the_permission(kube, caplog):
    kube.forbid = True
    watcher = ConfigMapWatcher(NAME, "k", lambda *_: None)
    try:
        wait_for(lambda: "needs get/list/watch on configmaps" in caplog.text, "the permission error")
        assert any(r.levelname == "ERROR" for r in caplog.records if "cannot watch" in r.getMessage())
    finally:
        watcher.close()
    assert os.environ["POD_NAMESPACE"] == NAMESPACE and watcher.namespace == NAMESPACE
