"""Hostile clients at the HTTP front door, spoken by hand over raw sockets: what an HTTP library
never does (connections that send nothing, headers or bodies a byte at a time, streams never
read with a tiny receive buffer), each from a chosen local address (``127.0.0.2``: another client
host on one machine).

``tests/integration/test_http_hostile.py`` asserts the front door's bounds with these, and
``python -m bench.hostile`` runs them as phases beside a well-behaved client.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Self


def connect(
    port: int, *, source: str = "127.0.0.1", host: str = "127.0.0.1", rcvbuf: int = 0
) -> socket.socket:
    """A TCP connection to ``host:port`` from ``source``; ``rcvbuf``: a receive buffer this small
    (set before connecting, so the window announced is small too)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((source, 0))
    sock.settimeout(10.0)
    sock.connect((host, port))
    return sock


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the peer closes ``sock`` (end of file or reset) within ``seconds``; what it sent
    before is read and dropped."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except OSError:
            return True


def read_status(sock: socket.socket, timeout_s: float = 30.0) -> int:
    """The status code of the answer's first line (0 when the connection ends before one)."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n" not in data:
        try:
            chunk = sock.recv(4096)
        except OSError:
            return 0
        if not chunk:
            return 0
        data += chunk
    return int(data.split(b" ", 2)[1])


def read_response(sock: socket.socket, timeout_s: float = 30.0) -> tuple[int, bytes]:
    """(status, body) of one answer with a Content-Length on a connection that stays open."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(head.split(b" ", 2)[1]), body


def keep_alive_get(path: str) -> bytes:
    """``GET path`` asking to keep the connection open."""
    return _request("GET", path, None, close=False)


def _request(method: str, path: str, body: bytes | None, close: bool = True) -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: expertcache"]
    if body is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    if close:
        head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + (body or b"")


def _exchange(port: int, data: bytes, *, source: str, timeout_s: float) -> tuple[int, bytes]:
    sock = connect(port, source=source)
    try:
        sock.settimeout(timeout_s)
        sock.sendall(data)
        reply = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    finally:
        sock.close()
    if not reply:
        return 0, b""
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def get(port: int, path: str, *, source: str = "127.0.0.1", timeout_s: float = 30.0) -> tuple[int, bytes]:
    """(status, body) of ``GET path`` on a connection of its own."""
    return _exchange(port, _request("GET", path, None), source=source, timeout_s=timeout_s)


def post_json(
    port: int, path: str, body: dict, *, source: str = "127.0.0.1", timeout_s: float = 60.0
) -> tuple[int, bytes]:
    """(status, body) of ``POST path`` with a JSON body, on a connection of its own."""
    return _exchange(
        port, _request("POST", path, json.dumps(body).encode()), source=source, timeout_s=timeout_s
    )


def stream_request(port: int, body: dict, *, source: str, rcvbuf: int = 4096) -> socket.socket:
    """A ``stream: true`` completion sent whole on a connection whose answer is never read."""
    sock = connect(port, source=source, rcvbuf=rcvbuf)
    sock.sendall(_request("POST", "/v1/completions", json.dumps(body).encode(), close=False))
    return sock


def body_trickle(port: int, *, declared: int, sent: bytes, source: str) -> socket.socket:
    """Headers declaring ``declared`` body bytes, then only ``sent`` of them."""
    sock = connect(port, source=source)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: expertcache\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n"
    )
    sock.sendall(head.encode() + sent)
    return sock


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the peer has closed the non-blocking ``sock`` (what it sent is left unread)."""
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _still_open(socks: list[socket.socket]) -> list[socket.socket]:
    """``socks`` less those the peer closed, which are closed here too."""
    alive = []
    for sock in socks:
        if _closed_by_peer(sock):
            sock.close()
        else:
            alive.append(sock)
    return alive


class _Holder:
    """Connections (``_socks``) that a thread of its own (``_run``) keeps open from ``start``
    until ``stop``, which waits ``join_s`` for it and closes them."""

    join_s = 5.0

    def __init__(self, socks: list[socket.socket] | dict[socket.socket, int], *, name: str) -> None:
        self._socks = socks
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    def start(self) -> Self:
        self._thread.start()
        return self

    def _run(self) -> None:
        raise NotImplementedError

    def held(self) -> int:
        """Connections open now (as far as this side has seen)."""
        with self._lock:
            return len(self._socks)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.join_s)
        with self._lock:
            for sock in list(self._socks):
                sock.close()
            self._socks.clear()


class IdleFlood(_Holder):
    """``connections`` connections from ``source`` that send nothing, kept open: each one the
    server closes is counted and opened again."""

    def __init__(self, port: int, *, connections: int, source: str) -> None:
        super().__init__([], name="http-idle-flood")
        self.port, self.wanted, self.source = port, connections, source
        self.opened = 0
        self.closed_by_server = 0
        self.refused = 0

    def _open(self) -> None:
        try:
            sock = connect(self.port, source=self.source)
        except OSError:
            self.refused += 1
            return
        sock.setblocking(False)
        with self._lock:
            self._socks.append(sock)
        self.opened += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            while len(self._socks) < self.wanted and not self._stop.is_set():
                self._open()
            alive = _still_open(self._socks)
            self.closed_by_server += len(self._socks) - len(alive)
            with self._lock:
                self._socks = alive
            self._stop.wait(0.05)


class Trickle(_Holder):
    """``connections`` connections from ``source`` sending a request a byte every ``interval_s``:
    its headers (``kind="headers"``) or, after whole headers declaring 1 MB, its body
    (``kind="body"``). One the server closes is counted and opened again."""

    join_s = 10.0

    def __init__(
        self, port: int, *, connections: int, source: str, kind: str = "headers", interval_s: float = 1.0
    ) -> None:
        super().__init__({}, name=f"http-trickle-{kind}")  # socket -> bytes of the drip sent
        if kind == "headers":
            self._prefix, self._drip = b"", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100_000
        else:
            self._prefix = (
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000000\r\n\r\n"
            )
            self._drip = b'{"prompt": "' + b"a" * 999_000
        self.port, self.wanted, self.source, self.interval_s = port, connections, source, interval_s
        self.opened = 0
        self.closed_by_server = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            while len(self._socks) < self.wanted and not self._stop.is_set():
                try:
                    sock = connect(self.port, source=self.source)
                    sock.sendall(self._prefix)
                except OSError:
                    continue
                sock.setblocking(False)
                self._socks[sock] = 0
                self.opened += 1
            for sock, sent in list(self._socks.items()):
                if _closed_by_peer(sock):
                    self._gone(sock)
                    continue
                try:
                    sock.send(self._drip[sent : sent + 1])
                    self._socks[sock] = sent + 1
                except BlockingIOError:
                    pass
                except OSError:
                    self._gone(sock)
            self._stop.wait(self.interval_s)

    def _gone(self, sock: socket.socket) -> None:
        self.closed_by_server += 1
        self._socks.pop(sock, None)
        sock.close()


class UnreadStreams(_Holder):
    """``count`` ``stream: true`` completions from ``source`` whose answers are never read (a
    4 KiB receive buffer); each answered with a status is counted by it, and one the server
    closes is opened again."""

    join_s = 30.0

    def __init__(self, port: int, body: dict, *, count: int, source: str) -> None:
        super().__init__([], name="http-unread")
        self.port, self.body, self.count, self.source = port, body, count, source
        self.statuses: dict[int, int] = {}

    def _run(self) -> None:
        while not self._stop.is_set():
            while len(self._socks) < self.count and not self._stop.is_set():
                try:
                    sock = stream_request(self.port, self.body, source=self.source)
                    status = read_status(sock, timeout_s=10)
                except OSError:
                    continue
                self.statuses[status] = self.statuses.get(status, 0) + 1
                if status == 200:
                    sock.setblocking(False)
                    self._socks.append(sock)
                else:
                    sock.close()
            self._socks = _still_open(self._socks)
            self._stop.wait(0.2)


class RefusedBodies:
    """``count`` bodies of ``size`` bytes sent at once, ``{"prompt": [1, 1, ...]}``: far more
    token ids than any prompt may hold, refused after parsing."""

    def __init__(self, port: int, *, count: int, size: int, source: str, model: str = "m") -> None:
        head = b'{"model": ' + json.dumps(model).encode() + b', "prompt": ['
        ids = (size - len(head) - 2) // 2
        self.body = head + b"1," * (ids - 1) + b"1]}"
        self.port, self.count, self.source = port, count, source
        self.statuses: dict[int, int] = {}
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._send, daemon=True) for _ in range(count)]

    def start(self) -> RefusedBodies:
        for thread in self._threads:
            thread.start()
        return self

    def _send(self) -> None:
        data = _request("POST", "/v1/completions", None)[:-2]  # headers without their end
        data += f"Content-Type: application/json\r\nContent-Length: {len(self.body)}\r\n\r\n".encode()
        try:
            status, _ = _exchange(self.port, data + self.body, source=self.source, timeout_s=120)
        except OSError:
            status = 0
        with self._lock:
            self.statuses[status] = self.statuses.get(status, 0) + 1

    def held(self) -> int:
        return sum(t.is_alive() for t in self._threads)

    def stop(self) -> None:
        for thread in self._threads:
            thread.join(120)
