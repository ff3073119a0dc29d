"""The fd handoff (``expertcache.handoff``): memfds and a payload from the daemon to one client over
a unix socket, refusals by code, and a server and a client that treat the other side as hostile
(silent, trickling, garbage, oversized, too many connections, unexpected descriptors) without
leaking a descriptor or hanging."""

from __future__ import annotations

import hmac
import logging
import os
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
from pathlib import Path

import pytest

from expertcache import errors, handoff
from expertcache.handoff import (
    HANDOFF_TOKEN_BYTES,
    MAX_GRANT_FDS,
    MAX_PAYLOAD_BYTES,
    REPLY_MAGIC,
    REQUEST_MAGIC,
    Grant,
    HandoffServer,
    receive,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

TOKEN = bytes(range(HANDOFF_TOKEN_BYTES))
WRONG = bytes(HANDOFF_TOKEN_BYTES)
HEADER = struct.Struct("!4sBBBxI")


@pytest.fixture
def sock_dir(tmp_path):
    """tmp_path, or a shorter directory when tmp_path would make a socket path too long (108 bytes)."""
    if len(os.fsencode(tmp_path)) < 60:
        yield tmp_path
        return
    short = Path(tempfile.mkdtemp(prefix="handoff-"))
    try:
        yield short
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def serve(sock_dir):
    """``serve(grant, **options)`` -> a started HandoffServer at sock_dir/h.sock, closed afterwards."""
    servers = []

    def make(grant, **options) -> HandoffServer:
        server = HandoffServer(str(sock_dir / "h.sock"), grant, **options)
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def memfds() -> int:
    """This process's open memfds made by ``memfd`` (what a grant carries): a count that handler
    threads finishing their sockets in the background do not change."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:handoff-test")
        except OSError:  # closed meanwhile (listdir's own fd, a socket a handler just closed)
            pass
    return count


def memfd(data: bytes = b"") -> int:
    fd = os.memfd_create("handoff-test", os.MFD_CLOEXEC)
    os.write(fd, data)
    return fd


def token_grant(make_fds=lambda: [], payload: bytes = b"{}"):
    """A grant callback that wants TOKEN (FailedPrecondition otherwise) and records its calls."""
    calls: list[tuple[bytes, int]] = []

    def grant(token: bytes, pid: int) -> Grant:
        calls.append((token, pid))
        if not hmac.compare_digest(token, TOKEN):
            raise errors.FailedPrecondition("unknown handoff token")
        return Grant(payload=payload, fds=make_fds())

    grant.calls = calls
    return grant


def connect(path: str, timeout_s: float = 10.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    sock.connect(path)
    return sock


def read_to_eof(sock: socket.socket) -> bytes:
    out = bytearray()
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        out += data
    return bytes(out)


def exchange(path: str, data: bytes, *, fds=(), shut_wr: bool = False) -> bytes:
    """Send ``data`` (with ``fds``) raw, read the reply to EOF."""
    with connect(path) as sock:
        try:
            if fds:
                socket.send_fds(sock, [data], list(fds))
            else:
                sock.sendall(data)
            if shut_wr:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return read_to_eof(sock)


def refusal(reply: bytes) -> tuple[str, str]:
    """(code, message) of a refusal reply."""
    magic, status, nfds, code_len, payload_len = HEADER.unpack(reply[: HEADER.size])
    assert (magic, status, nfds) == (REPLY_MAGIC, 1, 0), reply
    body = reply[HEADER.size :]
    assert len(body) == code_len + payload_len
    return body[:code_len].decode(), body[code_len:].decode()


def still_open(sock: socket.socket) -> bool:
    """True while the server has neither answered nor closed ``sock``."""
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    finally:
        sock.settimeout(10.0)
    return False


# -- grants ----------------------------------------------------------------------------------


def test_a_grant_carries_two_memfds_and_its_payload(serve):
    table, region = memfd(b"slot table"), memfd(b"private region")
    try:
        server = serve(token_grant(lambda: [os.dup(table), os.dup(region)], payload=b'{"slots": 8}'))
        payload, fds = receive(server.path, TOKEN)
        try:
            assert payload == b'{"slots": 8}'
            assert len(fds) == 2
            assert os.pread(fds[0], 64, 0) == b"slot table"
            assert os.pread(fds[1], 64, 0) == b"private region"
            os.pwrite(fds[1], b"PRIVATE", 0)  # the same file, not a copy
            assert os.pread(region, 7, 0) == b"PRIVATE"
            assert not any(os.get_inheritable(fd) for fd in fds)  # close-on-exec: no child gets them
        finally:
            for fd in fds:
                os.close(fd)
    finally:
        os.close(table)
        os.close(region)


def test_a_grant_without_fds_and_a_payload_at_the_limit(serve):
    server = serve(token_grant(payload=b"x" * MAX_PAYLOAD_BYTES))
    assert receive(server.path, TOKEN) == (b"x" * MAX_PAYLOAD_BYTES, [])


def test_the_callback_gets_the_token_and_the_peer_pid(serve):
    grant = token_grant()
    server = serve(grant)
    receive(server.path, TOKEN)
    assert grant.calls == [(TOKEN, os.getpid())]


def test_a_wrong_token_is_refused_with_the_callbacks_code_and_message(serve):
    grant = token_grant()
    server = serve(grant)
    with pytest.raises(errors.FailedPrecondition, match="unknown handoff token"):
        receive(server.path, WRONG)
    assert grant.calls == [(WRONG, os.getpid())]


class Cancelled(errors.ExpertCacheError):
    grpc_code = "CANCELLED"


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (errors.ResourceExhausted("every client slot is taken"), errors.ResourceExhausted),
        (errors.InvalidArgument("token of a stopped client"), errors.InvalidArgument),
        (errors.NotFound("no such client"), errors.NotFound),
        (errors.Unavailable("daemon stopping"), errors.Unavailable),
        (Cancelled("gone"), errors.ExpertCacheError),  # a code receive() has no class for
    ],
)
def test_refusals_arrive_as_the_exception_of_their_code(serve, raised, expected):
    def grant(token, pid):
        raise raised

    server = serve(grant)
    with pytest.raises(expected, match=str(raised)) as info:
        receive(server.path, TOKEN)
    assert type(info.value) is expected
    if isinstance(raised, Cancelled):
        assert "CANCELLED" in str(info.value)


def test_a_long_refusal_message_is_cut_to_the_payload_limit(serve):
    def grant(token, pid):
        raise errors.FailedPrecondition("é" * MAX_PAYLOAD_BYTES)  # 2 bytes each in UTF-8

    server = serve(grant)
    with pytest.raises(errors.FailedPrecondition) as info:
        receive(server.path, TOKEN)
    assert 0 < len(str(info.value).encode()) <= MAX_PAYLOAD_BYTES + 3  # a cut character: U+FFFD


def test_a_failing_callback_is_internal_and_does_not_stop_the_server(serve, caplog):
    def grant(token, pid):
        if token == WRONG:
            raise RuntimeError("bug in the daemon")
        return Grant(b"ok", [])

    server = serve(grant)
    with caplog.at_level(logging.WARNING, logger="expertcache.handoff"):
        with pytest.raises(errors.ExpertCacheError, match="INTERNAL") as info:
            receive(server.path, WRONG)
    assert "bug in the daemon" not in str(info.value)  # the daemon's internals stay in its log
    assert any("bug in the daemon" in r.getMessage() for r in caplog.records)
    assert receive(server.path, TOKEN) == (b"ok", [])


@pytest.mark.parametrize(
    "bad",
    [
        lambda fds: Grant(b"x" * (MAX_PAYLOAD_BYTES + 1), fds),
        lambda fds: Grant(b"", fds + [memfd() for _ in range(MAX_GRANT_FDS + 1 - len(fds))]),
        lambda fds: Grant("not bytes", fds),  # type: ignore[arg-type]
        lambda fds: (os.close(fds[0]), None)[1],  # not a Grant at all
    ],
)
def test_an_invalid_grant_is_refused_and_its_fds_are_closed(serve, bad):
    server = serve(lambda token, pid: bad([memfd(b"secret")]))
    with pytest.raises(errors.ExpertCacheError, match="INTERNAL"):
        receive(server.path, TOKEN)
    wait_for(lambda: memfds() == 0, "the invalid grant's fds closed")
    assert receive_and_close(server.path) is None  # still serving


def receive_and_close(path: str) -> None:
    try:
        _, fds = receive(path, TOKEN)
    except errors.ExpertCacheError:
        return
    for fd in fds:
        os.close(fd)


# -- descriptors do not leak -----------------------------------------------------------------


def test_the_server_closes_granted_fds_and_nothing_leaks_over_many_grants(serve):
    server = serve(token_grant(lambda: [memfd(b"a"), memfd(b"b")]), max_connections=4)
    receive_and_close(server.path)  # warm up: the accept thread's selector, a pool thread
    wait_for(lambda: memfds() == 0, "the warm-up's fds closed")
    before = open_fds()
    for _ in range(100):
        payload, fds = receive(server.path, TOKEN)
        assert len(fds) == 2
        for fd in fds:
            os.close(fd)
        with pytest.raises(errors.FailedPrecondition):
            receive(server.path, WRONG)
    # The handler closes the grant's fds after sending, possibly just after receive() returned;
    # its socket too (the warm-up's may still have been open when `before` was counted).
    wait_for(lambda: memfds() == 0, "every grant's fds closed")
    wait_for(lambda: open_fds() <= before, f"fds back to {before}")


def test_fds_are_closed_when_the_client_is_gone_before_the_reply(serve):
    client_gone = threading.Event()
    grant_made: list[bool] = []

    def grant(token, pid):
        assert client_gone.wait(10)
        grant_made.append(True)
        return Grant(b"late", [memfd(b"x"), memfd(b"y")])

    server = serve(grant)
    with connect(server.path) as sock:
        sock.sendall(REQUEST_MAGIC + TOKEN)
    client_gone.set()
    wait_for(lambda: len(grant_made) == 1, "the grant made")
    wait_for(lambda: memfds() == 0, "the undeliverable grant's fds closed")


def test_fds_sent_with_a_request_are_refused_and_closed(serve):
    grant = token_grant()
    server = serve(grant)
    extra = [memfd(b"from a client") for _ in range(6)]  # more than the server has room for
    try:
        reply = exchange(server.path, REQUEST_MAGIC + TOKEN, fds=extra)
    finally:
        for fd in extra:
            os.close(fd)
    assert refusal(reply) == ("INVALID_ARGUMENT", "a handoff request carries no file descriptors")
    wait_for(lambda: memfds() == 0, "the client's fds closed by the server")
    assert grant.calls == []
    for count in (1, 2):  # the ones it has room for, too
        extra = [memfd(b"from a client") for _ in range(count)]
        try:
            assert refusal(exchange(server.path, REQUEST_MAGIC, fds=extra))[0] == "INVALID_ARGUMENT"
        finally:
            for fd in extra:
                os.close(fd)
        wait_for(lambda: memfds() == 0, "the client's fds closed by the server")


# -- a hostile or broken client --------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "shut_wr", "message"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"A" * 64, False, "not a handoff request"),
        (b"ECH\x02" + TOKEN, False, "wire version 2 is not supported"),
        (REQUEST_MAGIC + TOKEN[:10], True, "cut short"),
        (REQUEST_MAGIC, True, "cut short"),
        (b"EC", True, "cut short"),
        (REQUEST_MAGIC + TOKEN + b"\xff" * 100_000, False, "longer than 36 bytes"),
    ],
    ids=["garbage", "version", "short-token", "no-token", "short-magic", "oversized"],
)
def test_malformed_requests_are_answered_and_the_server_keeps_serving(serve, data, shut_wr, message):
    grant = token_grant()
    server = serve(grant)
    code, text = refusal(exchange(server.path, data, shut_wr=shut_wr))
    assert code == "INVALID_ARGUMENT"
    assert message in text
    assert grant.calls == []
    assert receive(server.path, TOKEN) == (b"{}", [])


def test_a_connection_closed_at_once_does_no_harm(serve):
    server = serve(token_grant())
    for _ in range(20):
        connect(server.path).close()
    assert receive(server.path, TOKEN) == (b"{}", [])


def test_an_error_while_admitting_a_connection_does_not_end_the_accept_loop(serve, monkeypatch):
    server = serve(token_grant())
    admit, failed = server._admit, []

    def failing_once(conn):
        if not failed:
            failed.append(conn)
            raise ValueError("injected")
        admit(conn)

    monkeypatch.setattr(server, "_admit", failing_once)
    with pytest.raises(errors.Unavailable, match=server.path):  # closed unanswered (EOF or reset)
        receive(server.path, TOKEN)
    assert receive(server.path, TOKEN) == (b"{}", [])


def test_client_failures_are_logged_once_per_kind_without_tracebacks(serve, caplog):
    server = serve(token_grant())
    with caplog.at_level(logging.WARNING, logger="expertcache.handoff"):
        for _ in range(5):
            exchange(server.path, b"garbage!" * 8)
            with pytest.raises(errors.FailedPrecondition):
                receive(server.path, WRONG)
        server.close()  # the handlers have all finished: every line is in
    lines = [r for r in caplog.records if r.name == "expertcache.handoff"]
    assert all(r.levelno == logging.WARNING and not r.exc_info for r in lines)
    assert sum("not a handoff request" in r.getMessage() for r in lines) == 1
    assert sum("unknown handoff token" in r.getMessage() for r in lines) == 1


def test_silent_and_trickling_clients_are_cut_while_a_good_one_is_served(serve):
    timeout_s = 3.0  # the margin for serving the good client meanwhile, on a loaded machine
    server = serve(token_grant(), timeout_s=timeout_s)
    started = time.monotonic()
    silent = connect(server.path)
    trickler = connect(server.path)
    cut = threading.Event()

    def trickle():  # one byte at a time, slower than a request could finish within timeout_s
        try:
            for byte in REQUEST_MAGIC + TOKEN:
                trickler.send(bytes([byte]))
                if cut.wait(timeout_s / 4):
                    return
        except OSError:
            pass

    thread = threading.Thread(target=trickle)
    thread.start()
    try:
        assert receive(server.path, TOKEN) == (b"{}", [])  # not held up by the two above
        assert still_open(silent), "the good client was only served after the silent one was cut"
        for sock in (silent, trickler):
            code, text = refusal(read_to_eof(sock))
            assert code == "DEADLINE_EXCEEDED"
            assert text == f"no complete handoff request within {timeout_s}s"
        assert time.monotonic() - started >= timeout_s  # cut no earlier than timeout_s
    finally:
        cut.set()
        thread.join(10)
        silent.close()
        trickler.close()
    assert not thread.is_alive()


def test_connections_beyond_max_connections_are_refused_at_once(serve):
    server = serve(token_grant(), timeout_s=3.0, max_connections=3)
    idle = [connect(server.path) for _ in range(5)]
    try:
        # The two beyond the limit are refused at once, not after timeout_s.
        refused = [refusal(read_to_eof(sock)) for sock in idle[3:]]
        assert [code for code, _ in refused] == ["RESOURCE_EXHAUSTED"] * 2
        assert "max_connections" in refused[0][1]
        with pytest.raises(errors.ResourceExhausted, match="max_connections"):
            receive(server.path, TOKEN, timeout_s=10)
        assert all(still_open(sock) for sock in idle[:3]), "refused only once the idle ones were cut"
        for sock in idle[:3]:  # cut after timeout_s ...
            assert refusal(read_to_eof(sock))[0] == "DEADLINE_EXCEEDED"
    finally:
        for sock in idle:
            sock.close()
    # ... and the server serves again (the handlers free their places just after replying).
    wait_for(lambda: _served(server.path), "a grant after the idle connections were cut")


def test_a_client_asking_again_after_its_reply_is_not_refused_while_the_handler_finishes(serve, monkeypatch):
    # The handler closes the grant's descriptors and its socket after the reply went out; here
    # it is slow at that. A client that asks again at once must not find its own previous
    # connection still counted against max_connections.
    close_fds = handoff._close_fds

    def slow_close_fds(fds):
        time.sleep(0.3)
        close_fds(fds)

    monkeypatch.setattr(handoff, "_close_fds", slow_close_fds)
    server = serve(token_grant(lambda: [memfd(b"a")]), max_connections=1)
    for _ in range(3):
        payload, fds = receive(server.path, TOKEN)
        assert (payload, len(fds)) == (b"{}", 1)
        for fd in fds:
            os.close(fd)
        with pytest.raises(errors.FailedPrecondition, match="unknown handoff token"):
            receive(server.path, WRONG)


def _served(path: str) -> bool:
    try:
        return receive(path, TOKEN) == (b"{}", [])
    except errors.ResourceExhausted:
        return False


# -- a hostile or broken server --------------------------------------------------------------


class FakeServer:
    """Answers one connection with ``reply`` (and ``fds``), or says nothing until closed."""

    def __init__(self, path: str, reply: bytes | None, fds: list[int] | None = None) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1)
        self.reply, self.fds = reply, list(fds or ())
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run)
        self.thread.start()

    def run(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.recv(64)
            if self.reply is None:
                self.done.wait(30)
            elif self.fds:
                socket.send_fds(conn, [self.reply], self.fds)
            else:
                conn.sendall(self.reply)

    def close(self) -> None:
        self.done.set()
        self.thread.join(10)
        self.listener.close()
        for fd in self.fds:
            os.close(fd)


def granted(payload: bytes, nfds: int, payload_len: int | None = None) -> bytes:
    n = len(payload) if payload_len is None else payload_len
    return HEADER.pack(REPLY_MAGIC, 0, nfds, 0, n) + payload


@pytest.mark.parametrize(
    ("reply", "nfds", "message"),
    [
        (granted(b"x", 1, payload_len=1 << 31), 0, "malformed reply header"),
        (granted(b"", 4), 6, "more than 4 file descriptors"),  # MSG_CTRUNC: only some arrive
        (granted(b"", 2), 1, "sent 1 file descriptors, its reply said 2"),
        (granted(b"", 1), 2, "sent 2 file descriptors, its reply said 1"),
        (HEADER.pack(REPLY_MAGIC, 1, 0, 4, 2) + b"NOPEhi", 2, "sent 2 file descriptors, its reply said 0"),
        (HEADER.pack(REPLY_MAGIC, 1, 0, 5, 0) + b"bad!!", 0, "malformed status code"),
        (HEADER.pack(b"HTTP", 0, 0, 0, 0), 1, "malformed reply header"),
        (granted(b"abc", 0, payload_len=10), 0, "closed the connection before its reply was complete"),
        (b"", 0, "closed the connection before its reply was complete"),
    ],
    ids=["huge", "ctrunc", "fewer", "more", "fds-on-refusal", "code", "magic", "short", "nothing"],
)
def test_receive_rejects_a_hostile_reply_and_closes_what_it_got(sock_dir, reply, nfds, message):
    path = str(sock_dir / "fake.sock")
    before = open_fds()
    assert memfds() == 0
    fake = FakeServer(path, reply, [memfd(b"unwanted") for _ in range(nfds)])
    try:
        with pytest.raises(errors.Unavailable, match=message):
            receive(path, TOKEN, timeout_s=10)
    finally:
        fake.close()
    assert memfds() == 0
    assert open_fds() == before


def test_receive_gives_up_on_a_server_that_never_answers(sock_dir):
    path = str(sock_dir / "mute.sock")
    fake = FakeServer(path, None)
    try:
        with pytest.raises(errors.Unavailable, match=r"no reply within 0\.3s"):
            receive(path, TOKEN, timeout_s=0.3)
    finally:
        fake.close()


def test_receive_names_a_missing_socket(sock_dir):
    path = str(sock_dir / "absent.sock")
    with pytest.raises(errors.Unavailable, match=f"{path} cannot be reached"):
        receive(path, TOKEN)


def test_receive_against_a_stale_socket_file_is_unavailable(sock_dir):
    path = str(sock_dir / "stale.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()
    with pytest.raises(errors.Unavailable, match=path):
        receive(path, TOKEN)


@pytest.mark.parametrize("token", [b"", b"x" * (HANDOFF_TOKEN_BYTES - 1), b"x" * 33, "x" * 32])
def test_receive_wants_a_token_of_the_right_size(sock_dir, token):
    with pytest.raises(errors.InvalidArgument, match="32 bytes"):
        receive(str(sock_dir / "any.sock"), token)


# -- the socket file -------------------------------------------------------------------------


def test_the_socket_is_0600_replaces_a_stale_one_and_close_removes_it(sock_dir):
    path = sock_dir / "h.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    server = HandoffServer(str(path), token_grant())
    try:
        server.start()
        mode = os.stat(path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        assert server.path == str(path)
        assert receive(str(path), TOKEN) == (b"{}", [])
        assert sorted(p.name for p in sock_dir.iterdir()) == ["h.sock"]  # no temporary name left
    finally:
        server.close()
    assert not path.exists()
    server.close()  # idempotent
    with pytest.raises(errors.Unavailable):
        receive(str(path), TOKEN)


def test_close_leaves_a_socket_that_replaced_this_one(sock_dir):
    path = str(sock_dir / "h.sock")
    first = HandoffServer(path, token_grant())
    second = HandoffServer(path, token_grant())  # a restarted daemon took the path over
    first.close()
    try:
        assert os.path.exists(path)
        second.start()
        assert receive(path, TOKEN) == (b"{}", [])
    finally:
        second.close()
    assert not os.path.exists(path)


def test_a_path_that_is_not_a_socket_is_not_replaced(sock_dir):
    path = sock_dir / "h.sock"
    path.write_text("not a socket")
    with pytest.raises(errors.FailedPrecondition, match="not a socket"):
        HandoffServer(str(path), token_grant())
    assert path.read_text() == "not a socket"


def test_close_cuts_waiting_clients_without_waiting_for_timeout(serve):
    server = serve(token_grant(), timeout_s=30.0)
    idle = connect(server.path)
    try:
        assert receive(server.path, TOKEN) == (b"{}", [])  # accepted in order: idle is in a handler
        started = time.monotonic()
        server.close()
        assert time.monotonic() - started < 10.0  # not the 30 s the idle client had
        assert refusal(read_to_eof(idle)) == ("UNAVAILABLE", f"handoff server at {server.path} is closing")
    finally:
        idle.close()


def test_options_are_checked(sock_dir):
    with pytest.raises(errors.InvalidArgument, match="timeout_s"):
        HandoffServer(str(sock_dir / "h.sock"), token_grant(), timeout_s=0)
    with pytest.raises(errors.InvalidArgument, match="max_connections"):
        HandoffServer(str(sock_dir / "h.sock"), token_grant(), max_connections=0)
    with pytest.raises(errors.InvalidArgument, match="longer than 107 bytes"):
        HandoffServer("/tmp/" + "x" * 120, token_grant())
