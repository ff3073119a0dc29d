"""Hostile clients at the HTTP front door of a real compute process, spoken by hand over raw
sockets (``bench.http_hostile``): what the ``openai`` client never does.

- a connection that sends nothing, or its headers a byte at a time, is closed after
  ``http_header_timeout_s``;
- a flood of idle connections from one host costs that host its own idlest connections: health
  answers, from another host and from the flooding one;
- an answer given before the body arrived (413, 405) closes the connection;
- a client gone mid-body is counted, not logged as an error;
- a stream its client does not read is cut on the bytes it has not taken, although the kernel's
  buffers would have taken every write;
- one client host holds at most its share of the HTTP places, another is served beside it.

The attacks come from 127.0.0.2, the well-behaved client from 127.0.0.1: two hosts on one machine.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from bench.http_hostile import (
    IdleFlood,
    body_trickle,
    closed_within,
    connect,
    get,
    keep_alive_get,
    post_json,
    read_response,
    read_status,
    stream_request,
)
from tests.procs import free_port, start_compute, start_daemon
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

HEADER_TIMEOUT_S = 1.0
STALL_S = 1.0
MAX_CONNECTIONS = 200  # per client host: max(64, 0.5 x 200) = 100
ATTACKER = "127.0.0.2"
CLIENT = "127.0.0.1"


@pytest.fixture(scope="module")
def served(tiny_store, tmp_path_factory):
    tiny = tiny_store("mixtral")
    work = tmp_path_factory.mktemp("http-hostile")
    daemon = start_daemon(
        tiny.store, work, device="cpu", device_budget_bytes=tiny.manifest.num_blobs * tiny.manifest.blob_bytes
    )
    port = free_port()
    extra = [
        "--http-listen-address", f"127.0.0.1:{port}",
        "--http-header-timeout-s", str(HEADER_TIMEOUT_S),
        "--http-max-connections", str(MAX_CONNECTIONS),
        "--http-max-requests", "8",
        "--request-timeout-s", "3",
        "--stream-stall-timeout-s", str(STALL_S),
        "--max-batch-size", "4",
        "--max-waiting-requests", "4",
    ]  # fmt: skip
    try:
        compute = start_compute(tiny.store, daemon, work, extra=extra)
    except BaseException:
        daemon.stop()
        raise
    yield {"port": port, "compute": compute, "daemon": daemon}
    compute.stop()
    daemon.stop()


def model(served) -> str:
    status, body = get(served["port"], "/v1/models", source=CLIENT)
    assert status == 200
    return json.loads(body)["data"][0]["id"]


def completes(served, source: str = CLIENT) -> tuple[int, float]:
    """(status, seconds) of a short completion."""
    started = time.monotonic()
    status, _ = post_json(
        served["port"],
        "/v1/completions",
        {"model": model(served), "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True},
        source=source,
    )
    return status, time.monotonic() - started


def long_stream(served) -> dict:
    """A streamed completion of 2,000 tokens (as many as the tiny model's 2,048 positions allow):
    far more than an unread stream's buffers take, and seconds of generation (about 2 ms a token
    here), so an unread one is cut (``STALL_S`` after its buffers fill) before it could finish."""
    return {
        "model": model(served),
        "prompt": [5, 6, 7],
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }


def health_s(port: int, source: str) -> float:
    started = time.monotonic()
    status, _ = get(port, "/health", source=source, timeout_s=10)
    assert status == 200
    return time.monotonic() - started


def test_idle_and_trickling_connections_are_closed_after_the_header_timeout(served):
    port = served["port"]
    idle = connect(port, source=ATTACKER)
    trickling = connect(port, source=ATTACKER)
    stop = threading.Event()

    def trickle():
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000:
            if stop.is_set():
                return
            try:
                trickling.send(bytes([byte]))
            except OSError:
                return
            time.sleep(HEADER_TIMEOUT_S / 5)

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        # Closed by the server: end of file, well before the connections' 30 s of patience.
        assert closed_within(idle, 30 * HEADER_TIMEOUT_S)
        assert closed_within(trickling, 30 * HEADER_TIMEOUT_S)
    finally:
        stop.set()
        idle.close()
        trickling.close()
    assert "http_header_timeout_s" in served["compute"].log()


def test_a_keep_alive_connection_may_wait_between_requests_but_not_trickle_one(served):
    """Idle between two requests past the header timeout: kept (uvicorn's idle timeout governs);
    the next request's headers, once begun, must be whole within the header timeout."""
    sock = connect(served["port"], source=CLIENT)
    try:
        sock.sendall(keep_alive_get("/health"))
        assert read_response(sock)[0] == 200
        time.sleep(3 * HEADER_TIMEOUT_S)  # the time passing is what is tested
        sock.sendall(keep_alive_get("/health"))
        assert read_response(sock)[0] == 200
        sock.sendall(b"GET /hea")
        assert closed_within(sock, 30 * HEADER_TIMEOUT_S)
    finally:
        sock.close()


def test_a_flood_of_idle_connections_costs_its_sender_its_own_connections(served):
    port = served["port"]
    reference = min(health_s(port, CLIENT) for _ in range(3))
    flood = IdleFlood(port, connections=300, source=ATTACKER).start()
    try:
        wait_for(lambda: flood.opened >= 300, "300 idle connections opened", timeout_s=60)
        for source in (CLIENT, ATTACKER):
            fastest = min(health_s(port, source) for _ in range(3))
            assert fastest < max(1.0, 50 * reference), (source, fastest, reference)
        # The server closed the flood's connections (yielded to newer ones, or timed out).
        wait_for(
            lambda: flood.closed_by_server >= 100, "the server closing the flood's connections", timeout_s=60
        )
        assert completes(served)[0] == 200
    finally:
        flood.stop()


def test_an_answer_before_the_body_arrived_closes_the_connection(served):
    port = served["port"]
    too_large = connect(port, source=ATTACKER)
    too_large.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000000000\r\n\r\n{"model":'
    )
    assert read_status(too_large) == 413
    assert closed_within(too_large, 30 * HEADER_TIMEOUT_S)
    wrong_method = connect(port, source=ATTACKER)
    wrong_method.sendall(b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    assert read_status(wrong_method) == 405
    assert closed_within(wrong_method, 30 * HEADER_TIMEOUT_S)


def test_a_client_gone_mid_body_is_counted_not_logged_as_an_error(served):
    compute = served["compute"]
    before = compute.log()
    for _ in range(5):
        sock = body_trickle(served["port"], declared=1000, sent=b'{"model": "m", "prom', source=ATTACKER)
        time.sleep(0.2)
        sock.close()
    assert completes(served)[0] == 200  # the requests above were through before this one
    new = compute.log()[len(before) :]
    assert "ClientDisconnect" not in new and "Traceback" not in new and " ERROR " not in new, new


def test_an_unread_stream_is_cut_on_what_its_client_has_not_taken(served):
    compute = served["compute"]
    before = compute.log().count("stream_stall_timeout_s")
    body = long_stream(served)
    sock = stream_request(served["port"], body, source=ATTACKER, rcvbuf=4096)
    try:
        wait_for(
            lambda: compute.log().count("stream_stall_timeout_s") > before,
            "the unread stream cut",
            timeout_s=120,
        )
        # Its request is cancelled before its 2,000 tokens (its batch place and pins go).
        line = wait_for(
            lambda: [x for x in compute.log().splitlines() if "stopped (cancelled)" in x],
            "the cut request stopped",
            timeout_s=30,
        )[-1]
        generated = int(line.split("after ")[1].split(" generated")[0])
        assert generated < 2000, line
    finally:
        sock.close()
    assert completes(served)[0] == 200


def test_one_client_host_holds_its_share_of_the_http_places(served):
    """8 HTTP places and a batch of 4 + 4 waiting, max_client_share 0.5: the attacker's 8 unread
    streams get 4 places (429 beyond, naming the share); another host's completion is served."""
    body = long_stream(served)
    socks = [stream_request(served["port"], body, source=ATTACKER, rcvbuf=4096) for _ in range(8)]
    try:
        statuses = [read_status(s) for s in socks]
        assert sorted(statuses) == [200] * 4 + [429] * 4, statuses
        assert completes(served, CLIENT)[0] == 200
    finally:
        for s in socks:
            s.close()


def test_a_flood_of_connections_never_runs_compute_out_of_descriptors(tiny_store, tmp_path):
    """Compute under ``ulimit -n 1024``, 1,100 idle connections from one host: connections are
    bounded below the limit (backlog included), so accepting never fails with EMFILE (it failed
    39,498 times in 10 s, logged rate-limited, with uvicorn's backlog of 2,048), and health answers."""
    tiny = tiny_store("mixtral")
    daemon = start_daemon(
        tiny.store,
        tmp_path,
        device="cpu",
        device_budget_bytes=tiny.manifest.num_blobs * tiny.manifest.blob_bytes,
    )
    port = free_port()
    try:
        compute = start_compute(
            tiny.store,
            daemon,
            tmp_path,
            extra=["--http-listen-address", f"127.0.0.1:{port}"],
            open_files=1024,
        )
    except BaseException:
        daemon.stop()
        raise
    try:
        reference = min(health_s(port, CLIENT) for _ in range(3))
        flood = IdleFlood(port, connections=1100, source=ATTACKER).start()
        try:
            wait_for(lambda: flood.closed_by_server >= 200, "the flood's connections yielding", timeout_s=60)
            fastest = min(health_s(port, CLIENT) for _ in range(3))
            assert fastest < max(1.0, 50 * reference), (fastest, reference)
        finally:
            flood.stop()
        log = compute.log()
        assert "Too many open files" not in log and '"ERROR"' not in log, log[-2000:]
        assert "max_connections_per_client 320 reached" in log
    finally:
        compute.stop()
        daemon.stop()
