"""Hostile clients at the transport: HTTP/2 spoken by hand (``h2``), below what a gRPC library lets
a client do.

- ``header_only``: streams that send a call's HEADERS and never its request message;
- ``unread``: streams that send a whole request and then never read the answer (a tiny HTTP/2
  window, no WINDOW_UPDATE), so that the server's writes block;

Both keep their connections alive the way a patient attacker would: they answer SETTINGS and PING
frames, and re-open a stream as soon as the server ends one (``Attack.hold``). ``refused_prompts``
sends prompts too large to be served (refused with INVALID_ARGUMENT) through a normal gRPC stub.

``python -m bench.serve --mode hostile`` (``make bench-load BENCH_LOAD_ARGS=--hostile``) runs them
one after another against real compute and predictor processes while a well-behaved client
measures health and short Generates; ``tests/integration/test_hostile_transport.py`` asserts the
issue's bounds with the same code.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings

from bench.report import write_json
from bench.stats import percentile
from bench.usage import rss_mib

GENERATE = "/moe.inference.v1.Inference/Generate"


def grpc_frame(message: bytes) -> bytes:
    """A gRPC length-prefixed message (not compressed)."""
    return struct.pack(">BI", 0, len(message)) + message


@dataclass
class StreamTally:
    opened: int = 0
    ended: int = 0  # the server ended it (trailers or RST_STREAM)
    statuses: dict[str, int] = field(default_factory=dict)  # grpc-status of those that carried one
    refused_streams: int = 0  # RST_STREAM REFUSED_STREAM (over max_concurrent_streams)


class H2Connection:
    """One connection to ``host:port`` (or the unix socket ``host="unix:/path"``) speaking
    HTTP/2 with prior knowledge (gRPC's h2c)."""

    def __init__(self, host: str, port: int, *, window: int = 65535, authority: str = "") -> None:
        if host.startswith("unix:"):  # the daemon's socket: host "unix:/path", port unused
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(10.0)
            self.sock.connect(host.removeprefix("unix:").removeprefix("//"))
            authority = authority or "localhost"
        else:
            self.sock = socket.create_connection((host, port), timeout=10.0)
        self.sock.settimeout(0.2)
        self.authority = authority or f"{host}:{port}"
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        self.conn.local_settings = h2.settings.Settings(client=True)
        self.conn.initiate_connection()
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.lock = threading.Lock()
        self.open_streams: set[int] = set()
        self.tally = StreamTally()
        self.closed = False
        self._flush()

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def open(
        self, path: str, message: bytes | None, metadata: tuple[tuple[str, str], ...] = ()
    ) -> int | None:
        """Open a call to ``path``: HEADERS, then (when ``message`` is not None) the request and
        END_STREAM. None when the connection cannot open more streams now."""
        with self.lock:
            if self.closed:
                return None
            if self.conn.open_outbound_streams >= self.conn.remote_settings.max_concurrent_streams:
                return None
            stream_id = self.conn.get_next_available_stream_id()
            headers = [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", self.authority),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                *metadata,
            ]
            self.conn.send_headers(stream_id, headers, end_stream=False)
            if message is not None:
                self.conn.send_data(stream_id, grpc_frame(message), end_stream=True)
            self.open_streams.add(stream_id)
            self.tally.opened += 1
            self._flush()
            return stream_id

    def pump(self) -> bool:
        """Read what the server sent and answer SETTINGS and PINGs (``h2`` queues the ACKs); DATA
        is never acknowledged, so a window the server filled stays full. False once closed."""
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return not self.closed
        except OSError:
            data = b""
        with self.lock:
            if not data:
                self.closed = True
                self.open_streams.clear()
                return False
            for event in self.conn.receive_data(data):
                if isinstance(event, h2.events.TrailersReceived):
                    status = dict(event.headers).get("grpc-status", "?")
                    self.tally.statuses[status] = self.tally.statuses.get(status, 0) + 1
                    self._ended(event.stream_id)
                elif isinstance(event, h2.events.ResponseReceived) and event.stream_ended is not None:
                    status = dict(event.headers).get("grpc-status", "?")  # trailers-only response
                    self.tally.statuses[status] = self.tally.statuses.get(status, 0) + 1
                    self._ended(event.stream_id)
                elif isinstance(event, h2.events.StreamReset):
                    if event.error_code == h2.errors.ErrorCodes.REFUSED_STREAM:
                        self.tally.refused_streams += 1
                    self._ended(event.stream_id)
                elif isinstance(event, h2.events.ConnectionTerminated):
                    self.closed = True
            try:
                self._flush()
            except OSError:
                self.closed = True
            return not self.closed

    def _ended(self, stream_id: int) -> None:
        if stream_id in self.open_streams:
            self.open_streams.discard(stream_id)
            self.tally.ended += 1

    def close(self) -> None:
        with self.lock:
            self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


class Attack:
    """``connections`` connections with ``streams`` calls each to ``path``, kept open: a call the
    server ends is opened again (``reopen=False``: each connection opens its calls once). ``message``: None for header-only calls, else the request sent
    whole; ``window``: the HTTP/2 window announced (small: the answers are never read)."""

    def __init__(
        self,
        host: str,
        port: int,
        path: str,
        *,
        connections: int,
        streams: int,
        message: bytes | None = None,
        window: int = 65535,
        metadata: tuple[tuple[str, str], ...] = (),
        reopen: bool = True,
    ) -> None:
        self.host, self.port, self.path = host, port, path
        self.connections_wanted = connections
        self.streams = streams
        self.message = message
        self.window = window
        self.metadata = metadata
        self.reopen = reopen
        self.conns: list[H2Connection] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> Attack:
        for _ in range(self.connections_wanted):
            conn = H2Connection(self.host, self.port, window=self.window)
            self.conns.append(conn)
            thread = threading.Thread(target=self._hold, args=(conn,), daemon=True, name="hostile-h2")
            self._threads.append(thread)
            thread.start()
        return self

    def _hold(self, conn: H2Connection) -> None:
        opened = 0
        while not self._stop.is_set():
            while len(conn.open_streams) < self.streams and not conn.closed:
                if not self.reopen and opened >= self.streams:
                    break
                if conn.open(self.path, self.message, self.metadata) is None:
                    break
                opened += 1
            if not conn.pump():
                return

    def held(self) -> int:
        """Streams open right now, all connections together."""
        return sum(len(c.open_streams) for c in self.conns)

    def tally(self) -> StreamTally:
        total = StreamTally()
        for c in self.conns:
            total.opened += c.tally.opened
            total.ended += c.tally.ended
            total.refused_streams += c.tally.refused_streams
            for k, v in c.tally.statuses.items():
                total.statuses[k] = total.statuses.get(k, 0) + v
        return total

    def wait_held(self, count: int, timeout_s: float = 10.0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.held() < count:
            time.sleep(0.02)
        return self.held()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2.0)
        for conn in self.conns:
            conn.close()


# -- the benchmark: python -m bench.hostile (make bench-hostile) ----------------------------------
class WellBehaved:
    """A normal client beside the attack: a health Check and a short Generate in turn, each
    timed; a Generate refused with RESOURCE_EXHAUSTED (the server is full) is retried, and its
    time counts until it succeeds."""

    def __init__(self, address: str, tokens: int = 3) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        from moe.inference.v1 import inference_pb2, inference_pb2_grpc

        self._grpc = grpc
        self._channel = grpc.insecure_channel(address)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._health_request = health_pb2.HealthCheckRequest(service="")
        self._serving = health_pb2.HealthCheckResponse.SERVING
        self._stub = inference_pb2_grpc.InferenceStub(self._channel)
        self._request = inference_pb2.GenerateRequest(text="hello", max_new_tokens=tokens)
        self.health_s: list[float] = []
        self.generate_s: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _once(self) -> None:
        grpc = self._grpc
        start = time.monotonic()
        try:
            ok = self._health.Check(self._health_request, timeout=5).status == self._serving
            self.health_s.append(time.monotonic() - start) if ok else self.failures.append(
                "health not SERVING"
            )
        except grpc.RpcError as exc:
            self.failures.append(f"health {exc.code().name}")
        start = time.monotonic()
        while not self._stop.is_set():
            try:
                list(self._stub.Generate(self._request, timeout=60))
                self.generate_s.append(time.monotonic() - start)
                return
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.failures.append(f"Generate {exc.code().name}")
                    return
                time.sleep(0.1)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._once()
            self._stop.wait(0.2)

    def start(self) -> WellBehaved:
        self._thread = threading.Thread(target=self._run, daemon=True, name="well-behaved")
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=90)
        self._channel.close()
        return {
            "health_p50_s": percentile(self.health_s, 50),
            "health_p99_s": percentile(self.health_s, 99),
            "health_max_s": max(self.health_s, default=float("nan")),
            "generate_p50_s": percentile(self.generate_s, 50),
            "generate_p99_s": percentile(self.generate_s, 99),
            "generates": len(self.generate_s),
            "failures": self.failures,
        }


def main(argv: list[str] | None = None) -> int:
    """Real daemon, compute and predictor processes on a tiny random mixtral; each attack of the
    issue "Hostile clients" in turn for ``--seconds``, a well-behaved client measuring beside it."""
    import argparse
    import tempfile
    from pathlib import Path

    from moe.inference.v1 import inference_pb2

    from cache_daemon.convert import convert
    from devtools.launch import free_port, start, start_compute, start_daemon
    from devtools.tiny import make_checkpoint
    from expertcache.manifest import read_manifest

    parser = argparse.ArgumentParser(prog="python -m bench.hostile", description=main.__doc__)
    parser.add_argument("--seconds", type=float, default=12.0, help="how long each attack is held")
    parser.add_argument("--stall-s", type=float, default=3.0, help="compute's stream_stall_timeout_s")
    parser.add_argument("--request-timeout-s", type=float, default=5.0, help="request_timeout_s of compute")
    parser.add_argument("--prompts", type=int, default=20, help="refused 1 MB prompts")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "hostile.json"
    )
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench-hostile-"))
    checkpoint = make_checkpoint("mixtral", work / "checkpoint")
    convert(checkpoint, work / "store")
    manifest = read_manifest(work / "store")
    daemon = start_daemon(
        work / "store", work, device="cpu", device_budget_bytes=manifest.num_blobs * manifest.blob_bytes
    )
    extra = [
        "--stream-stall-timeout-s",
        str(args.stall_s),
        "--request-timeout-s",
        str(args.request_timeout_s),
    ]
    compute = start_compute(work / "store", daemon, work, extra=extra)
    predictor_address = f"127.0.0.1:{free_port()}"
    predictor = start(
        "predictor_svc", ["--listen-address", predictor_address], predictor_address, work / "p.log"
    )
    host, port = compute.address.rsplit(":", 1)
    results: dict = {"seconds": args.seconds, "phases": {}}

    def phase(name: str, attack_factory, settle_s: float = 0.0) -> None:
        rss0 = rss_mib(compute.popen.pid)
        client = WellBehaved(compute.address).start()
        attack = attack_factory()
        time.sleep(args.seconds)
        held = attack.held() if attack is not None else 0
        if attack is not None:
            attack.stop()
        figures = client.stop()
        figures.update(held_at_end=held, rss_start_mib=rss0, rss_peak_mib=rss_mib(compute.popen.pid))
        if settle_s:
            time.sleep(settle_s)
            figures["rss_after_settle_mib"] = rss_mib(compute.popen.pid)
        results["phases"][name] = figures
        print(
            f"{name:>14}: health p99 {figures['health_p99_s'] * 1e3:7.1f} ms (max {figures['health_max_s'] * 1e3:.1f}), "
            f"short Generate p50 {figures['generate_p50_s'] * 1e3:7.1f} ms p99 {figures['generate_p99_s'] * 1e3:7.1f} ms "
            f"({figures['generates']} done), failures {len(figures['failures'])}, compute RSS "
            f"{rss0:.0f} -> {figures['rss_peak_mib']:.0f} MiB"
            + (f" -> {figures['rss_after_settle_mib']:.0f} after {settle_s:g} s" if settle_s else ""),
            flush=True,
        )

    class _Prompts:
        """``--prompts`` prompts of 1 MB of text, each refused with INVALID_ARGUMENT."""

        def __init__(self) -> None:
            import grpc
            from moe.inference.v1 import inference_pb2_grpc

            self.codes: dict[str, int] = {}
            channel = grpc.insecure_channel(
                compute.address, options=[("grpc.max_send_message_length", 8 << 20)]
            )
            stub = inference_pb2_grpc.InferenceStub(channel)
            text = "lorem ipsum dolor sit amet " * (1_000_000 // 27)

            def send() -> None:
                for _ in range(args.prompts):
                    try:
                        list(
                            stub.Generate(
                                inference_pb2.GenerateRequest(text=text, max_new_tokens=1), timeout=60
                            )
                        )
                        code = "OK"
                    except grpc.RpcError as exc:
                        code = exc.code().name
                    self.codes[code] = self.codes.get(code, 0) + 1
                channel.close()

            self._thread = threading.Thread(target=send, daemon=True)
            self._thread.start()

        def held(self) -> int:
            return 0

        def stop(self) -> None:
            self._thread.join(timeout=600)
            results["refused_prompts"] = self.codes

    unread = inference_pb2.GenerateRequest(text="hello there", max_new_tokens=400, ignore_eos=True)
    try:
        phase("baseline", lambda: None)
        phase("header-only", lambda: Attack(host, int(port), GENERATE, connections=12, streams=10).start())
        phase(
            "unread",
            lambda: Attack(
                host,
                int(port),
                GENERATE,
                connections=10,
                streams=10,
                message=unread.SerializeToString(),
                window=64,
            ).start(),
        )
        phase("refused-1MB", _Prompts, settle_s=30.0)
        phost, pport = predictor_address.rsplit(":", 1)
        attack = Attack(
            phost, int(pport), "/moe.predictor.v1.Predictor/GetStats", connections=12, streams=10
        ).start()
        client = WellBehaved(predictor_address)
        health = []
        for _ in range(int(args.seconds / 0.5)):
            start_t = time.monotonic()
            client._health.Check(client._health_request, timeout=5)
            health.append(time.monotonic() - start_t)
            time.sleep(0.5)
        results["phases"]["predictor-header-only"] = {
            "health_p99_s": percentile(health, 99),
            "held": attack.held(),
        }
        print(
            f"predictor header-only: {attack.held()} held, health p99 {percentile(health, 99) * 1e3:.1f} ms"
        )
        attack.stop()
    finally:
        predictor.stop()
        compute.stop()
        daemon.stop()
    write_json(args.out, results, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
