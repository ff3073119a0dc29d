"""The chart's commands really run: helm/expertcache rendered by the real Helm (as in
test_chart.py), and each container of the GPU pod (compute, daemon) and of the predictor started
here exactly as the rendered manifests say, then one Generate served over the real gRPC socket.

From the manifests, per container: the image's entry command (the Dockerfile's ENTRYPOINT of the
image's target, a console script, mapped to this venv's script of that name), the args, the env
(literal values, and the downward API's metadata.name / metadata.namespace) and the image's ENV;
the volumes its containers mount (emptyDir, the ConfigMap's data written as files, the store).
Only what a pod has and this machine does not is remapped, and every remap is checked complete
(no pod path, no cluster host name, no 0.0.0.0 is left in an argument):

- each volume's mountPath → a directory under a temporary pod root (the shared memory-backed
  /run/expertcache is one directory for both containers of the GPU pod, as in the pod); the store
  volume → a tiny real store;
- container and Service ports → free local ports, 0.0.0.0 → 127.0.0.1;
- Service host names (the predictor's, the Redis StatefulSet pod's) → 127.0.0.1 and the local port;
- the image's /opt/venv/bin → this venv's bin, its WORKDIR → the pod's /tmp volume.

Values: the chart's own CPU variant (daemon.device cpu, gpu.mode none), with budgets that fit the
tiny store; metrics.enabled=false only while a service lacks the metrics flags (see ``rendered``);
compute.http.enabled=true only once compute has --http-listen-address (another branch adds the
front door; the chart's default is off, so compute is never passed a flag it refuses).
Checked: every container becomes healthy, one Generate streams its tokens, the predictor saw the
request and wrote its EAM to the Redis the chart names, then the ``helm test`` Pod's containers run
in the kubelet's order (its init containers each to completion, then the main one), started the
same way as the services' (their ``command`` is the expertcache CLI on the image's PATH, i.e. this
venv's script), each exiting 0: compute's and the predictor's health, one generate through the
Services' addresses; each /metrics answers; with compute.http, GET /health and /v1/models answer. Not started: the Redis StatefulSet (a local redis-server takes its place: the
image is not Python, and redis-server is what it runs) and the convert init container (off by
default; the store is built by the tiny_store fixture, through the same converter).

A flag renamed in code and not in the chart makes its process exit 2 before it serves: the run
fails, naming the flag; ``test_a_flag_unknown_to_a_service_fails_the_run`` shows that for each
service with one flag of the rendered args renamed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from moe.inference.v1 import inference_pb2, inference_pb2_grpc
from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc

from devtools.launch import free_port, wait_healthy
from devtools.redis_server import RedisServer, redis_server_binary
from tests.charts import (
    FULLNAME,
    NAMESPACE,
    container,
    gpu_pod,
    one,
    predictor_pod,
    service_flags,
)
from tests.charts import render as render_chart
from tests.dockerfile import chain, entry_command, parse_stages

pytestmark = pytest.mark.deploy

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
POD_NAMES = {
    "gpu": f"{FULLNAME}-gpu-7d9f8-abcde",
    "predictor": f"{FULLNAME}-predictor-6c5b4-fghij",
    "test": f"{FULLNAME}-test",  # the helm test hook: a bare Pod, named as rendered
}


def cpu_values(manifest) -> tuple[str, ...]:
    """The chart's CPU variant, budgets sized to the tiny store: a quarter of its experts in the
    (host-memory) arena, all of them in the host tier."""
    device = max(1, manifest.num_blobs // 4) * manifest.blob_bytes
    return (
        "daemon.device=cpu",
        "gpu.mode=none",
        f"daemon.deviceBudgetBytes={device}",
        f"daemon.hostBudgetBytes={manifest.num_blobs * manifest.blob_bytes}",
    )


# -- from a rendered container to a local command ----------------------------------------------------
class Remap:
    """Pod paths, ports and host names → local ones, for the containers of the rendered docs."""

    def __init__(self, docs: list[dict], root: Path, store: Path, redis: RedisServer) -> None:
        self.root = root
        self.store = store
        self.ports: dict[int, int] = {}
        self.hosts: dict[str, str] = {}  # "name:port" → "127.0.0.1:local"
        # A Service reaches the container port its targetPort names, in the pods it selects.
        # The Redis StatefulSet is not started: its Service and its pod's stable name are the
        # local redis-server.
        redis_set = one(docs, "StatefulSet", f"{FULLNAME}-redis")
        redis_service = redis_set["spec"]["serviceName"]
        for service in (d for d in docs if d["kind"] == "Service"):
            name = service["metadata"]["name"]
            for p in service["spec"]["ports"]:
                if name == redis_service:
                    local = redis.port
                    self.hosts[f"{redis_set['metadata']['name']}-0.{name}:{p['port']}"] = f"127.0.0.1:{local}"
                else:
                    local = self.port(target_port(docs, service, p))
                self.hosts[f"{name}:{p['port']}"] = f"127.0.0.1:{local}"

    def port(self, pod_port: int) -> int:
        if pod_port not in self.ports:
            self.ports[pod_port] = free_port()
        return self.ports[pod_port]

    def volumes(self, pod: dict, pod_name: str, data: dict[str, dict[str, str]]) -> dict[str, Path]:
        """Each volume of the pod as a local directory (its contents as the pod would see them)."""
        out = {}
        for volume in pod["spec"]["volumes"]:
            name = volume["name"]
            if name == "store":  # hostPath or PVC: the expert store
                out[name] = self.store
                continue
            path = self.root / pod_name / name
            path.mkdir(parents=True)
            if "configMap" in volume:
                for key, text in data[volume["configMap"]["name"]].items():
                    (path / key).write_text(text)
            else:
                assert "emptyDir" in volume, f"volume {name} of {pod_name}: no local stand-in for {volume}"
            out[name] = path
        return out

    def paths(self, c: dict, volumes: dict[str, Path]) -> list[tuple[str, str]]:
        mounts = [(m["mountPath"], str(volumes[m["name"]])) for m in c.get("volumeMounts", [])]
        return sorted(mounts, key=lambda m: -len(m[0]))  # longest mount path first

    def value(self, text: str, mounts: list[tuple[str, str]]) -> str:
        if mounts:  # one pass, longest mount path first: a local path is not remapped again
            locals_ = dict(mounts)
            pattern = "|".join(re.escape(pod_path) for pod_path, _ in mounts)
            text = re.sub(rf"(?:(?<![\w/.-])|(?<=://))({pattern})(?=/|$)", lambda m: locals_[m[1]], text)
        for host, local in self.hosts.items():
            text = text.replace(host, local)
        text = re.sub(r"0\.0\.0\.0:(\d+)", lambda m: f"127.0.0.1:{self.port(int(m[1]))}", text)
        text = re.sub(r"^(--[\w-]*port)=(\d+)$", lambda m: f"{m[1]}={self.port(int(m[2]))}", text)
        return "127.0.0.1" if text == "0.0.0.0" else text.replace("=0.0.0.0", "=127.0.0.1")


def target_port(docs: list[dict], service: dict, port: dict) -> int:
    """The container port a Service port reaches: its targetPort (a name or a number) in the
    workload whose pods the Service selects."""
    selector = service["spec"]["selector"]
    pods = [
        d["spec"]["template"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        and all(d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in selector.items())
    ]
    name = service["metadata"]["name"]
    assert len(pods) == 1, f"Service {name} selects {len(pods)} workloads"
    target = port.get("targetPort", port["port"])
    for c in pods[0]["spec"]["containers"]:
        for p in c.get("ports", []):
            if target in (p.get("name"), p["containerPort"]):
                return p["containerPort"]
    raise AssertionError(f"Service {name} port {port['port']}: no container port {target!r} in its pods")


def image_target(c: dict) -> str:
    """expertcache/compute:0.1.0 → compute: the Dockerfile target the image is built from."""
    match = re.fullmatch(r"expertcache/([\w-]+):[\w.-]+", c["image"])
    assert match, f"container {c['name']}: image {c['image']!r} is not one of the project's"
    return match[1]


def image_env(stages, target: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for stage in reversed(chain(stages, target)):
        for instruction, rest in stage.instructions:
            if instruction == "ENV":
                out.update(re.findall(r"(\w+)=(\S+)", rest))
    return out


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args (an unknown name stays as it is)."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), text)


def local_command(
    c: dict, pod: dict, pod_name: str, volumes: dict[str, Path], remap: Remap, stages, *, hook: bool = False
) -> tuple[list[str], dict[str, str], Path]:
    """(argv, env, cwd) of a rendered container, run here. The services run their image's
    entry command; only the helm test hook's containers give a command (the expertcache CLI, as
    the exec probes do), which the image finds on its PATH, in its venv."""
    mounts = remap.paths(c, volumes)
    target = image_target(c)
    if "command" in c:
        assert hook, f"{c['name']}: the chart overrides the image's command: {c['command']}"
        (script, *image_args) = c["command"]
        assert "/" not in script, f"{c['name']}: command {script!r} is a path, not the venv's script"
        assert "/opt/venv/bin" in image_env(stages, target).get("PATH", ""), f"{target}: no venv on PATH"
    else:
        (script, *image_args) = entry_command(stages, target)
    local_script = VENV_BIN / script
    assert local_script.is_file(), f"{c['name']}: the image runs {script}, which this venv does not install"
    fields = {"metadata.name": pod_name, "metadata.namespace": NAMESPACE}
    env: dict[str, str] = {}
    for key, value in image_env(stages, target).items():
        if key == "PATH":
            value = value.replace("/opt/venv/bin", str(VENV_BIN)).replace("$PATH", os.environ["PATH"])
        env[key] = remap.value(value, mounts)
    for item in c.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(item["value"], env)
        else:
            ref = item["valueFrom"].get("fieldRef", {}).get("fieldPath")
            assert ref in fields, f"{c['name']}: no local value for env {item['name']}: {item['valueFrom']}"
            env[item["name"]] = fields[ref]
    # The kubernetes client outside a pod reads a kubeconfig: none here (the watch retries, and
    # the mounted file is watched anyway), so that no real cluster is ever reached.
    env["KUBECONFIG"] = str(remap.root / "no-kubeconfig")
    args = [remap.value(expand(a, env), mounts) for a in [*image_args, *c.get("args", [])]]
    leftovers = [
        a
        for a in args
        if re.search(rf"[\w.-]*{FULLNAME}[\w.-]*:\d+", a)  # a cluster host name and port
        or "0.0.0.0" in a
        or any(
            p.startswith("/") and not p.startswith((str(remap.root), str(remap.store)))
            for p in re.findall(r"(?:^|=|//)(/[^\s,:]*)", a)
        )
    ]
    assert not leftovers, f"{c['name']}: arguments that still name the pod's world: {leftovers}"
    cwd = volumes["tmp"]  # the images' WORKDIR /tmp, the pod's tmp volume
    return [str(local_script), *args], {**os.environ, **env}, cwd


def launch(argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env)


def address_of(c: dict, argv: list[str]) -> str:
    """Where a started container answers health checks: its --listen-address or --socket-path."""
    flags = dict(a.partition("=")[::2] for a in argv if a.startswith("--"))
    if "--socket-path" in flags:
        return f"unix://{flags['--socket-path']}"
    assert "--listen-address" in flags, f"{c['name']}: neither --listen-address nor --socket-path"
    return flags["--listen-address"]


# -- the stack -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_store):
    return tiny_store("mixtral")


def compute_serves_http() -> bool:
    """Whether this checkout's compute has the OpenAI-compatible HTTP front door (another branch
    adds it): only then is the chart's compute.http rendered and started here."""
    return "--http-listen-address" in service_flags("compute_svc")


@pytest.fixture(scope="module")
def rendered(helm, tiny) -> list[dict]:
    sets = cpu_values(tiny.manifest)
    if compute_serves_http():
        sets += ("compute.http.enabled=true",)
    # The metrics flags are the observability branch's (test_chart.PENDING_FLAGS): until every
    # service knows them, the chart's default passes flags the services refuse, so they run with
    # metrics.enabled=false; once they exist this runs the chart's default, metrics on.
    if not all(
        "--metrics-port" in service_flags(m) for m in ("compute_svc", "cache_daemon", "predictor_svc")
    ):
        sets += ("metrics.enabled=false",)
    return render_chart(helm, *sets)


def pod_containers(docs: list[dict]) -> list[tuple[str, dict, dict]]:
    """(pod name, pod template, container) for every container this test starts."""
    gpu, predictor = gpu_pod(docs), predictor_pod(docs)
    # convert is an init container only with convert.enabled (off here): the store is given.
    assert "initContainers" not in gpu["spec"]
    return [
        (POD_NAMES["predictor"], predictor, container(predictor["spec"], "predictor")),
        (POD_NAMES["gpu"], gpu, container(gpu["spec"], "daemon")),
        (POD_NAMES["gpu"], gpu, container(gpu["spec"], "compute")),
    ]


def hook_containers(docs: list[dict]) -> list[tuple[str, dict, dict]]:
    """The helm test Pod's containers in the order the kubelet runs them: each init container
    to completion, then the main one."""
    hooks = [d for d in docs if d["kind"] == "Pod" and d["metadata"]["annotations"]["helm.sh/hook"] == "test"]
    assert len(hooks) == 1, f"{len(hooks)} helm test pods"
    pod = hooks[0]
    assert pod["metadata"]["name"] == POD_NAMES["test"]
    spec = pod["spec"]
    return [(POD_NAMES["test"], pod, c) for c in [*spec.get("initContainers", []), *spec["containers"]]]


Command = tuple[dict, list[str], dict[str, str], Path]


def commands(
    docs: list[dict], root: Path, store: Path, redis: RedisServer
) -> tuple[list[Command], list[Command]]:
    """(the services' commands, the helm test hook's in their order), one remap for both: the
    hook reaches the services through the same local ports."""
    remap = Remap(docs, root, store, redis)
    stages = parse_stages((REPO / "Dockerfile").read_text())[1]
    data = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    volumes: dict[str, dict[str, Path]] = {}
    services: list[Command] = []
    hook: list[Command] = []
    for out, containers in ((services, pod_containers(docs)), (hook, hook_containers(docs))):
        for pod_name, pod, c in containers:
            if pod_name not in volumes:
                volumes[pod_name] = remap.volumes(pod, pod_name, data)
            argv, env, cwd = local_command(
                c, pod, pod_name, volumes[pod_name], remap, stages, hook=out is hook
            )
            out.append((c, argv, env, cwd))
    return services, hook


def run_hook(hook: list[Command], root: Path) -> dict[str, subprocess.CompletedProcess]:
    """Each step of the helm test Pod, in order, as the kubelet runs them: a step that exits
    non-zero fails the test (helm test's verdict), and the next does not run."""
    done = {}
    for c, argv, env, cwd in hook:
        proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (
            f"helm test step {c['name']} exited {proc.returncode}: {argv}\n{proc.stdout}\n{proc.stderr}"
        )
        done[c["name"]] = proc
    return done


def test_the_rendered_commands_start_the_stack_and_serve_a_generate(rendered, tiny, tmp_path_factory):
    assert redis_server_binary(), "redis-server is not installed"
    root = tmp_path_factory.mktemp("pods")
    with RedisServer(root / "redis") as redis:
        started: list[tuple[dict, subprocess.Popen, str, Path]] = []
        metrics: list[tuple[str, str]] = []  # (container, local metrics port)
        try:
            services, hook = commands(rendered, root, tiny.store, redis)
            # All at once, as the kubelet starts a pod's containers; compute waits for the daemon.
            for c, argv, env, cwd in services:
                log = root / f"{c['name']}.log"
                started.append((c, launch(argv, env, cwd, log), address_of(c, argv), log))
                metrics += [(c["name"], a.partition("=")[2]) for a in argv if a.startswith("--metrics-port=")]
            for _, popen, address, log in started:
                wait_healthy(address, popen, log, timeout_s=150)
            compute = next(address for c, _, address, _ in started if c["name"] == "compute")
            predictor = next(address for c, _, address, _ in started if c["name"] == "predictor")
            with grpc.insecure_channel(compute) as channel:
                replies = list(
                    inference_pb2_grpc.InferenceStub(channel).Generate(
                        inference_pb2.GenerateRequest(
                            token_ids=list(range(5, 30)),
                            max_new_tokens=8,
                            ignore_eos=True,
                            request_id="chart",
                        ),
                        timeout=120,
                    )
                )
            assert [r.index for r in replies] == list(range(8))
            assert replies[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
            assert replies[0].cache.hits + replies[0].cache.misses > 0
            # compute reported the request to the predictor named by the chart, which keeps its
            # EAMC in the Redis the chart names.
            with grpc.insecure_channel(predictor) as channel:
                stub = predictor_pb2_grpc.PredictorStub(channel)
                deadline = time.monotonic() + 30
                while True:
                    stats = stub.GetStats(predictor_pb2.GetStatsRequest(), timeout=5)
                    if stats.requests_done >= 1 and stats.entries_inserted >= 1:
                        break
                    assert time.monotonic() < deadline, f"the predictor never saw the request: {stats}"
                    time.sleep(0.1)
            assert stats.store_kind == "redis" and stats.store_errors == 0
            # `helm test`: its Pod's commands, through the Services' (remapped) addresses.
            steps = run_hook(hook, root)
            assert list(steps) == ["compute-health", "predictor-health", "generate"]
            assert steps["compute-health"].stdout.endswith(
                "(service 'moe.inference.v1.Inference'): SERVING\n"
            )
            assert steps["predictor-health"].stdout.endswith(": SERVING\n")
            max_new = next(a for a in hook[-1][1] if a.startswith("--max-new-tokens="))
            assert f"[{max_new.partition('=')[2]} tokens in" in steps["generate"].stderr, steps[
                "generate"
            ].stderr
            http = [
                a.partition("=")[2]
                for c, argv, _, _ in services
                for a in argv
                if a.startswith("--http-listen-address=")
            ]
            if compute_serves_http():  # the chart's compute.http, once compute has the front door
                (address,) = http
                with urllib.request.urlopen(f"http://{address}/health", timeout=10) as reply:
                    assert reply.status == 200
                with urllib.request.urlopen(f"http://{address}/v1/models", timeout=10) as reply:
                    assert reply.status == 200 and json.loads(reply.read())["data"]
            else:
                assert http == []  # default off: never passed to a compute that refuses it
            for name, port in metrics:  # with metrics.enabled, each serves Prometheus text
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
                    assert reply.status == 200 and b"# TYPE" in reply.read(), name
            for c, popen, _, log in started:
                assert popen.poll() is None, f"{c['name']} exited {popen.returncode}:\n{log.read_text()}"
        finally:
            for _, popen, _, _ in reversed(started):  # compute first, then the daemon, the predictor
                if popen.poll() is None:
                    popen.terminate()
                    try:
                        popen.wait(30)
                    except subprocess.TimeoutExpired:
                        popen.kill()
                        popen.wait()


@pytest.mark.parametrize(
    ("name", "flag", "renamed"),
    [
        ("compute", "--drain-timeout-s", "--drain-timeout"),
        ("daemon", "--config-file", "--config-fil"),
        ("predictor", "--listen-address", "--listen-addr"),
    ],
)
def test_a_flag_unknown_to_a_service_fails_the_run(rendered, tiny, tmp_path_factory, name, flag, renamed):
    """A flag renamed in code and not in the chart: here the chart's flag is renamed instead (the
    same mismatch), and the process exits 2 naming it before it serves, so the run above fails.
    Each rename is a prefix of the real flag: the services' parsers take no abbreviations, so a
    code rename that only lengthens a flag (--drain-timeout → --drain-timeout-s) fails too."""
    root = tmp_path_factory.mktemp("pods")
    with RedisServer(root / "redis") as redis:
        (c, argv, env, cwd) = next(
            x for x in commands(rendered, root, tiny.store, redis)[0] if x[0]["name"] == name
        )
    address = address_of(c, argv)
    (index,) = [i for i, a in enumerate(argv) if a.startswith(f"{flag}=")]
    argv[index] = argv[index].replace(flag, renamed, 1)
    log = root / f"{name}.log"
    popen = launch(argv, env, cwd, log)
    try:
        with pytest.raises(RuntimeError, match="exited with 2 before serving"):
            wait_healthy(address, popen, log, timeout_s=120)
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait()
    assert f"unrecognized arguments: {argv[index]}" in log.read_text(), log.read_text()
