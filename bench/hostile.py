"""Hostile clients at the transport: HTTP/2 spoken by hand (``h2``), below what a gRPC library lets
a client do.

- ``header_only``: streams that send a call's HEADERS and never its request message;
- ``unread``: streams that send a whole request and then never read the answer (a tiny HTTP/2
  window, no WINDOW_UPDATE), so that the server's writes block;

Both keep their connections alive the way a patient attacker would: they answer SETTINGS and PING
frames, and re-open a stream as soon as the server ends one (``Attack.hold``). ``refused_prompts``
sends prompts too large to be served (refused with INVALID_ARGUMENT) through a normal gRPC stub.
The HTTP front door's attacks (idle connections, slow headers and bodies, unread SSE streams,
large refused bodies) are in ``bench.http_hostile``; a compute client writing random bytes into
all the shared memory it can write (``shm-fuzz``) is in ``bench.shm_hostile``.

``python -m bench.hostile`` (``make bench-hostile``) runs them all, one phase after another,
against real compute (with its HTTP API) and predictor processes at their default flags, while a
well-behaved client measures health and short requests over gRPC and HTTP, and checks each phase
against ``BOUNDS``; ``tests/integration/test_hostile_transport.py`` and
``tests/integration/test_http_hostile.py`` assert the same bounds with the same code.
"""

from __future__ import annotations

import json
import re
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

    def __init__(
        self, host: str, port: int, *, window: int = 65535, authority: str = "", source: str = ""
    ) -> None:
        """``source``: the local address to connect from (e.g. ``127.0.0.2``: another client
        host on one machine); empty: the system's choice."""
        if host.startswith("unix:"):  # the daemon's socket: host "unix:/path", port unused
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(10.0)
            self.sock.connect(host.removeprefix("unix:").removeprefix("//"))
            authority = authority or "localhost"
        else:
            bind = (source, 0) if source else None
            self.sock = socket.create_connection((host, port), timeout=10.0, source_address=bind)
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
    server ends is opened again (``reopen=False``: each connection opens its calls once).
    ``message``: None for header-only calls, else the request sent whole; ``window``: the HTTP/2
    window announced (small: the answers are never read); ``source``: the local address the
    connections come from (another client host)."""

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
        source: str = "",
    ) -> None:
        self.host, self.port, self.path = host, port, path
        self.source = source
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
            conn = H2Connection(self.host, self.port, window=self.window, source=self.source)
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

    def __init__(self, address: str, tokens: int = 3, http_port: int = 0, model: str = "") -> None:
        """``http_port``: also a health and a short completion over the HTTP API each turn (from
        127.0.0.1; the HTTP attacks come from 127.0.0.2), naming ``model``."""
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
        self.http_port, self.model, self.tokens = http_port, model, tokens
        self.http_health_s: list[float] = []
        self.http_generate_s: list[float] = []
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
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.failures.append(f"Generate {exc.code().name}")
                    break
                time.sleep(0.1)
        if self.http_port:
            self._http_once()

    def _http_once(self) -> None:
        from bench.http_hostile import get, post_json

        start = time.monotonic()
        try:
            status, _ = get(self.http_port, "/health", timeout_s=5)
        except OSError as exc:
            status = f"{type(exc).__name__}"
        if status == 200:
            self.http_health_s.append(time.monotonic() - start)
        else:
            self.failures.append(f"HTTP health {status}")
        body = {"model": self.model, "prompt": "hello", "max_tokens": self.tokens}
        start = time.monotonic()
        while not self._stop.is_set():
            try:
                status, _ = post_json(self.http_port, "/v1/completions", body, timeout_s=60)
            except OSError as exc:
                status = f"{type(exc).__name__}"
            if status == 200:
                self.http_generate_s.append(time.monotonic() - start)
                return
            if status != 429:
                self.failures.append(f"HTTP completion {status}")
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
            "http_health_max_s": max(self.http_health_s, default=float("nan")),
            "http_generate_max_s": max(self.http_generate_s, default=float("nan")),
            "http_generates": len(self.http_generate_s),
            "failures": self.failures,
        }


BOUNDS = {  # the bounds of every phase
    "health_max_s": 1.0,
    "http_health_max_s": 1.0,
    "generate_max_s": 10.0,
    "http_generate_max_s": 10.0,
    "rss_growth_mib": 200.0,
    # Lines other than each finished request's one summary line (the well-behaved client's own
    # requests write one each: about 6 a second here).
    "compute_log_lines_beyond_requests": 100,
    "daemon_log_lines": 100,
}
_REQUEST_SUMMARY = re.compile(rb"request \S+: \d+ prompt \+ \d+ generated tokens")


class _Peak:
    """The largest resident set of ``pid`` seen, sampled every 0.2 s on a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss_mib(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.peak = max(self.peak, rss_mib(self.pid))
            except OSError:
                return  # the process is gone

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(2)
        return max(self.peak, rss_mib(self.pid))


def _lines(path) -> tuple[int, int]:
    """(lines, lines that are not a finished request's summary) of the log at ``path``."""
    total = summaries = 0
    try:
        with open(path, "rb") as f:
            for line in f:
                total += 1
                summaries += bool(_REQUEST_SUMMARY.search(line))
    except OSError:
        pass
    return total, total - summaries


def main(argv: list[str] | None = None) -> int:
    """Real daemon, compute (with its HTTP API) and predictor processes on a tiny random mixtral,
    every flag at its default; each attack of the issues "Hostile clients" and "Nothing a client
    does stops the service" in turn for ``--seconds``, a well-behaved client (gRPC and HTTP, from
    127.0.0.1) measuring beside it; the HTTP attacks and the gRPC unread streams come from
    127.0.0.2. Each phase is checked against ``BOUNDS``; the exit code is 1 when one is not met."""
    import argparse
    import tempfile
    from pathlib import Path

    from moe.inference.v1 import inference_pb2

    from bench.http_hostile import IdleFlood, RefusedBodies, Trickle, UnreadStreams, get
    from bench.shm_hostile import RegionFuzz
    from cache_daemon.convert import convert
    from devtools.launch import free_port, start, start_compute, start_daemon
    from devtools.tiny import make_checkpoint
    from expertcache.manifest import read_manifest

    parser = argparse.ArgumentParser(prog="python -m bench.hostile", description=main.__doc__)
    parser.add_argument("--seconds", type=float, default=12.0, help="how long each attack is held")
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
    http_port = free_port()
    compute = start_compute(
        work / "store", daemon, work, extra=["--http-listen-address", f"127.0.0.1:{http_port}"]
    )
    predictor_address = f"127.0.0.1:{free_port()}"
    predictor = start(
        "predictor_svc", ["--listen-address", predictor_address], predictor_address, work / "p.log"
    )
    host, port = compute.address.rsplit(":", 1)
    model = json.loads(get(http_port, "/v1/models")[1])["data"][0]["id"]
    results: dict = {"seconds": args.seconds, "bounds": BOUNDS, "phases": {}}
    missed: list[str] = []

    def phase(name: str, attack_factory, settle_s: float = 0.0) -> None:
        rss0 = rss_mib(compute.popen.pid)
        logs0 = _lines(compute.log_path), _lines(daemon.log_path)
        peak = _Peak(compute.popen.pid)
        client = WellBehaved(compute.address, http_port=http_port, model=model).start()
        attack = attack_factory()
        time.sleep(args.seconds)
        held = attack.held() if attack is not None else 0
        if attack is not None:
            attack.stop()
        figures = client.stop()
        figures.update(
            held_at_end=held,
            rss_start_mib=rss0,
            rss_peak_mib=peak.stop(),
            generate_max_s=max(client.generate_s, default=float("nan")),
            compute_log_lines=_lines(compute.log_path)[0] - logs0[0][0],
            compute_log_lines_beyond_requests=_lines(compute.log_path)[1] - logs0[0][1],
            daemon_log_lines=_lines(daemon.log_path)[0] - logs0[1][0],
        )
        figures["rss_growth_mib"] = figures["rss_peak_mib"] - rss0
        for what in ("statuses", "closed_by_server", "opened", "attaches", "bytes_written", "errors"):
            if attack is not None and hasattr(attack, what):
                figures[f"attack_{what}"] = getattr(attack, what)
        if settle_s:
            time.sleep(settle_s)
            figures["rss_after_settle_mib"] = rss_mib(compute.popen.pid)
        over = [k for k, bound in BOUNDS.items() if not figures.get(k, float("nan")) <= bound]
        if getattr(attack, "writable", None):  # the shm fuzzer mapped the table or the arena writable
            figures["attack_writable"] = sorted(attack.writable)
            over.append("attack_writable")
        figures["bounds_missed"] = over
        missed.extend(f"{name}: {k} {figures.get(k)}" for k in over)
        results["phases"][name] = figures
        print(
            f"{name:>16}: health max gRPC {figures['health_max_s'] * 1e3:6.1f} ms HTTP "
            f"{figures['http_health_max_s'] * 1e3:6.1f} ms; short request max gRPC "
            f"{figures['generate_max_s']:5.2f} s HTTP {figures['http_generate_max_s']:5.2f} s "
            f"({figures['generates']}+{figures['http_generates']} done); failures {len(figures['failures'])}; "
            f"compute RSS +{figures['rss_growth_mib']:.0f} MiB; log lines compute {figures['compute_log_lines']} "
            f"({figures['compute_log_lines_beyond_requests']} beyond request summaries) "
            f"daemon {figures['daemon_log_lines']}; " + ("all bounds met" if not over else f"MISSED {over}"),
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
    sse = {"model": model, "prompt": "hello there", "max_tokens": 400, "ignore_eos": True, "stream": True}
    attacker = "127.0.0.2"
    try:
        phase("baseline", lambda: None)
        phase("header-only", lambda: Attack(host, int(port), GENERATE, connections=12, streams=10).start())
        phase(
            "grpc-unread",
            lambda: Attack(
                host,
                int(port),
                GENERATE,
                connections=10,
                streams=10,
                message=unread.SerializeToString(),
                window=64,
                source=attacker,
            ).start(),
        )
        phase("refused-1MB", _Prompts, settle_s=30.0)
        phase("http-idle-1000", lambda: IdleFlood(http_port, connections=1000, source=attacker).start())
        phase("http-slow-headers", lambda: Trickle(http_port, connections=300, source=attacker).start())
        phase(
            "http-slow-bodies",
            lambda: Trickle(http_port, connections=300, source=attacker, kind="body").start(),
        )
        phase("http-unread-sse", lambda: UnreadStreams(http_port, sse, count=200, source=attacker).start())
        phase(
            "http-refused-6MB",
            lambda: RefusedBodies(http_port, count=30, size=6 << 20, source=attacker, model=model).start(),
            settle_s=10.0,
        )
        phase("shm-fuzz", lambda: RegionFuzz(daemon.address.removeprefix("unix://")).start())
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
    results["bounds_missed"] = missed
    write_json(args.out, results, indent=2)
    print(f"wrote {args.out}")
    if missed:
        print("bounds missed:\n  " + "\n  ".join(missed))
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
