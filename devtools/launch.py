"""Starting the real service processes: used by the demo, the benchmarks and the integration tests."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from devtools.memory_cgroup import MemoryCgroup, confined_command
from expertcache.paths import MAX_DAEMON_SOCKET_PATH_BYTES, RUNTIME_DIR, ensure_private_dir

REPO = Path(__file__).resolve().parents[1]  # repository root: the processes run from here


def daemon_socket_path(work_dir: Path) -> Path:
    """``work_dir/daemon.sock``, or where that path is too long for a unix socket (a deep
    benchmark or test directory), a socket in a new private directory under the runtime
    directory (``expertcache.paths``), which ``Proc.stop`` of the daemon removes."""
    sock = work_dir / "daemon.sock"
    if len(os.fsencode(sock)) <= MAX_DAEMON_SOCKET_PATH_BYTES:  # its handoff socket fits beside it
        return sock
    short = tempfile.mkdtemp(prefix="launch-", dir=ensure_private_dir(RUNTIME_DIR))
    return Path(short) / "daemon.sock"


# Ports free_port has handed out in this process: never handed out twice.
_HANDED_PORTS: set[int] = set()
_HANDED_LOCK = threading.Lock()
_RANDOM = random.Random()
LOWEST_PORT = 10000  # below it lie the ports well-known services listen on


def listen_ports(local_range: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> range:
    """The ports ``free_port`` picks from: those the kernel never picks itself. A port it picks
    (for an outgoing connection, or a bind to port 0 in another test process) may be taken again
    between the probe and the server's bind; the servers do not share ports (no SO_REUSEPORT),
    so a server that lost that race would not start."""
    try:
        low, high = (int(x) for x in local_range.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default ephemeral range
    below = range(LOWEST_PORT, low)
    above = range(high + 1, 65536)
    return below if len(below) >= len(above) else above


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, outside the kernel's ephemeral range (``listen_ports``,
    at random in it: two test processes rarely probe the same one), and never one this process
    was given before (two servers of one launch, a listen address and a metrics port, would race
    for it)."""
    ports = listen_ports()
    with _HANDED_LOCK:
        for _ in range(1000):
            port = _RANDOM.randrange(ports.start, ports.stop)
            if port in _HANDED_PORTS:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue  # in use
            _HANDED_PORTS.add(port)
            return port
    raise RuntimeError(f"no free port in {ports} after 1000 tries ({len(_HANDED_PORTS)} handed out)")


@dataclass
class Proc:
    popen: subprocess.Popen
    address: str
    log_path: Path
    owned_dir: Path | None = None  # a directory made for this process alone, removed by ``stop``

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        if self.owned_dir is not None:
            shutil.rmtree(self.owned_dir, ignore_errors=True)
        return self.popen.returncode


def wait_healthy(
    address: str,
    proc: subprocess.Popen,
    log_path: Path,
    timeout_s: float = 120.0,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Until ``address`` answers SERVING; ``credentials`` for a TLS server (health needs no token)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"process exited with {proc.returncode} before serving:\n{log_path.read_text()}"
            )
        try:
            channel = (
                grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
            )
            with channel as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=1
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{address} not healthy after {timeout_s}s:\n{log_path.read_text()}")


def checkout_python(checkout: Path) -> Path:
    """The interpreter of another checkout of this project: its own ``.venv`` (``make install``
    there), which imports that checkout's code. ``ValueError`` naming what is missing."""
    python = Path(checkout) / ".venv" / "bin" / "python"
    if not python.is_file():
        raise ValueError(
            f"{checkout} has no {python.relative_to(checkout)}: run `make install` in that checkout"
        )
    return python


def start(
    module: str,
    args: list[str],
    address: str,
    log_path: Path,
    env: dict | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    checkout: Path | None = None,
    open_files: int | None = None,
    cgroup: MemoryCgroup | None = None,
) -> Proc:
    """``python -m module args`` from this checkout, or from ``checkout`` (another one, with its
    own ``.venv``: a benchmark's baseline), waited on until healthy at ``address``;
    ``open_files``: the process's limit on open descriptors (``ulimit -n``); ``cgroup``: the
    memory cgroup it runs in from its first instruction on."""
    python, cwd = (sys.executable, REPO) if checkout is None else (checkout_python(checkout), Path(checkout))
    log = open(log_path, "wb")
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    # No preexec_fn: the limit and the group are a shell's, which then execs the module.
    argv = confined_command([str(python), "-m", module, *args], cgroup=cgroup, open_files=open_files)
    popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=full_env)
    try:
        wait_healthy(address, popen, log_path, credentials=credentials)
    except BaseException:
        popen.kill()
        popen.wait()
        raise
    return Proc(popen, address, log_path)


def start_daemon(
    store_dir: Path,
    work_dir: Path,
    *,
    device: str,
    device_budget_bytes: int,
    host_budget_bytes: int = 0,
    extra: list[str] | None = None,
    checkout: Path | None = None,
    cgroup: MemoryCgroup | None = None,
) -> Proc:
    """``python -m cache_daemon`` on ``work_dir/daemon.sock`` (``daemon_socket_path``). ``device`` (``cpu``, ``cuda``,
    ``cuda:<n>`` or ``auto``) is required: the daemon's own default, ``auto``, takes a GPU
    where there is one, and a caller must know which arena it gets."""
    sock = daemon_socket_path(work_dir)
    args = [
        "--store-dir",
        str(store_dir),
        "--socket-path",
        str(sock),
        "--device",
        device,
        "--device-budget-bytes",
        str(device_budget_bytes),
        "--host-budget-bytes",
        str(host_budget_bytes),
        *(extra or []),
    ]
    owned = sock.parent if sock.parent != work_dir else None
    try:
        proc = start(
            "cache_daemon", args, f"unix://{sock}", work_dir / "daemon.log", checkout=checkout, cgroup=cgroup
        )
    except BaseException:
        if owned is not None:
            shutil.rmtree(owned, ignore_errors=True)
        raise
    proc.owned_dir = owned
    return proc


def start_compute(
    store_dir: Path,
    daemon: Proc,
    work_dir: Path,
    extra: list[str] | None = None,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    log_name: str = "compute.log",
    module: str = "compute_svc",
    checkout: Path | None = None,
    open_files: int | None = None,
    cgroup: MemoryCgroup | None = None,
) -> Proc:
    port = free_port()
    address = f"127.0.0.1:{port}"
    args = [
        "--store-dir",
        str(store_dir),
        "--daemon-address",
        daemon.address,
        "--listen-address",
        address,
        *(extra or []),
    ]
    return start(
        module,
        args,
        address,
        work_dir / log_name,
        credentials=credentials,
        checkout=checkout,
        open_files=open_files,
        cgroup=cgroup,
    )


def start_predictor(
    work_dir: Path,
    extra: list[str] | None = None,
    redis_url: str | None = None,
    *,
    port: int | None = None,
    embedded_path: Path | None = None,
    log_name: str = "predictor.log",
    credentials: grpc.ChannelCredentials | None = None,
) -> Proc:
    """``python -m predictor_svc`` on a free loopback port (or ``port``), waited on until healthy.

    Without ``redis_url`` the EAMC lives in the embedded store, saved to ``embedded_path``
    (default ``work_dir/eamc.bin``) when the process stops. Compute and daemon are pointed at it
    with ``extra=["--predictor-address", proc.address]``.
    """
    address = f"127.0.0.1:{port or free_port()}"
    args = ["--listen-address", address]
    if redis_url:
        args += ["--redis-url", redis_url]
    else:
        args += ["--embedded-path", str(embedded_path or work_dir / "eamc.bin")]
    return start(
        "predictor_svc", [*args, *(extra or [])], address, work_dir / log_name, credentials=credentials
    )
