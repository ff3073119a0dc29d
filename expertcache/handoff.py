"""File-descriptor handoff: the cache daemon gives one compute process its memfds over a unix socket.

The shared slot table and each client's private region are memfds. No path names them, so no
other process can map them; the daemon hands them to the one compute process they are for,
as ``SCM_RIGHTS`` ancillary data on a unix stream socket (mode 0600). The compute process
presents a token it got from the daemon (over gRPC) and gets back a small payload (e.g. JSON
describing the regions) and up to ``MAX_GRANT_FDS`` descriptors. Which token maps to which fds,
and whether the peer (its pid, from ``SO_PEERCRED``) may have them, is the ``grant`` callback's
decision (compare tokens with ``hmac.compare_digest``); this module is the transport only.

Wire format, one request and one reply per connection, integers big-endian::

    request  (client -> server), exactly 36 bytes, no descriptors:
        magic    4 bytes   b"ECH" + version (0x01)
        token   32 bytes   HANDOFF_TOKEN_BYTES

    reply    (server -> client), then the server closes the connection:
        magic        4 bytes   b"ECG" + version (0x01)
        status       u8        0 = granted, 1 = refused
        nfds         u8        descriptors attached (<= MAX_GRANT_FDS; 0 when refused)
        code_len     u8        length of code (0 when granted, 1..32 when refused)
        reserved     u8        0
        payload_len  u32       <= MAX_PAYLOAD_BYTES
        code         code_len bytes, ASCII: the gRPC status name (``FAILED_PRECONDITION``, ...)
        payload      payload_len bytes: the grant's payload, or the refusal's UTF-8 message

    The descriptors travel as one ``SCM_RIGHTS`` message attached to the reply's first byte
    (the whole reply is one ``sendmsg``).

Both ends treat the other as hostile: every length is bounded before anything is read, a
reply's descriptors must number exactly ``nfds`` (more, fewer, truncated ancillary data
(``MSG_CTRUNC``), descriptors on a refusal or in a later segment: all received ones are closed
and the reply is rejected), a request that carries descriptors is refused (and they are closed),
and received descriptors are close-on-exec (``MSG_CMSG_CLOEXEC``) so that no child the compute
process spawns inherits them.

The server reads each request within ``timeout_s`` of accepting it (a silent or trickling
client is cut then), serves at most ``max_connections`` connections at once on a pool of
threads (a connection beyond that is refused with ``RESOURCE_EXHAUSTED`` and closed at once,
from the accept thread, without blocking; a connection stops counting when its reply starts
out, so a client asking one request after another is never refused), and logs each kind of failure at most once per
``expertcache.logs.REFUSAL_LOG_INTERVAL_S`` (no traceback for what a client caused).
"""

from __future__ import annotations

import array
import errno
import logging
import os
import re
import secrets
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from expertcache import errors
from expertcache.logs import REFUSAL_LOG_INTERVAL_S, RateLimitedLog

log = logging.getLogger(__name__)

HANDOFF_TOKEN_BYTES = 32  # a token is exactly this many bytes
MAX_GRANT_FDS = 4  # fds one grant may carry
MAX_PAYLOAD_BYTES = 4096  # the grant's small payload (e.g. JSON) at most

WIRE_VERSION = 1
REQUEST_MAGIC = b"ECH" + bytes([WIRE_VERSION])
REPLY_MAGIC = b"ECG" + bytes([WIRE_VERSION])
REQUEST_BYTES = len(REQUEST_MAGIC) + HANDOFF_TOKEN_BYTES
_REPLY_FIELDS = struct.Struct("!BBBxI")  # status, nfds, code_len, reserved, payload_len
REPLY_HEADER_BYTES = len(REPLY_MAGIC) + _REPLY_FIELDS.size
MAX_CODE_BYTES = 32
STATUS_GRANTED = 0
STATUS_REFUSED = 1
_CODE_RE = re.compile(rb"[A-Z][A-Z_]{0,31}")
_FD_BYTES = array.array("i").itemsize
_UNIX_PATH_MAX = 107  # sun_path holds 108 bytes, the last one a NUL
_ACCEPT_BACKOFF_S = (0.01, 1.0)  # after a failed accept (EMFILE, ...): first and longest wait

# The refusal's gRPC code name -> the exception receive() raises. An unknown name raises
# ExpertCacheError naming it.
_CODE_ERRORS: dict[str, type[errors.ExpertCacheError]] = {
    cls.grpc_code: cls
    for cls in (
        errors.InvalidArgument,
        errors.NotFound,
        errors.FailedPrecondition,
        errors.ResourceExhausted,
        errors.Unavailable,
        errors.DataLoss,
        errors.DeadlineExceeded,
    )
}


@dataclass(frozen=True)
class Grant:
    """What the server sends for one request: ``payload`` (<= MAX_PAYLOAD_BYTES) and ``fds``
    (<= MAX_GRANT_FDS). The server closes ``fds`` once it has tried to send them, sent or not."""

    payload: bytes
    fds: list[int]


class _Truncated(Exception):
    """The ancillary data did not fit (MSG_CTRUNC): more descriptors came than were allowed."""


class _Refusal(Exception):
    """Answer the client with ``code`` and ``message``; log a line of kind ``kind``."""

    def __init__(self, code: str, message: str, kind: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.kind = kind


def _close_fds(fds) -> None:
    """Close each distinct descriptor of ``fds`` once (ints only; errors ignored)."""
    seen = set()
    for fd in fds:
        if isinstance(fd, int) and not isinstance(fd, bool) and fd >= 0 and fd not in seen:
            seen.add(fd)
            try:
                os.close(fd)
            except OSError:
                pass


def _recv_exact(sock: socket.socket, n: int, deadline: float, fds: list[int], max_fds: int) -> bytes:
    """Exactly ``n`` bytes from ``sock`` by ``deadline`` (time.monotonic). Descriptors that come
    with them are appended to ``fds`` (the caller closes them); _Truncated when the ancillary
    data overflowed room for ``max_fds``, EOFError when the peer closed first, TimeoutError."""
    buf = bytearray()
    ancillary = socket.CMSG_SPACE(max(max_fds, 1) * _FD_BYTES)
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out")
        sock.settimeout(remaining)
        data, ancdata, flags, _ = sock.recvmsg(n - len(buf), ancillary, socket.MSG_CMSG_CLOEXEC)
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(cdata[: len(cdata) - len(cdata) % _FD_BYTES])
                fds.extend(got)
        if flags & socket.MSG_CTRUNC:
            raise _Truncated()
        if not data:
            raise EOFError(f"closed after {len(buf)} of {n} bytes")
        buf += data
    return bytes(buf)


def _reply(status: int, nfds: int, code: bytes, payload: bytes) -> bytes:
    return REPLY_MAGIC + _REPLY_FIELDS.pack(status, nfds, len(code), len(payload)) + code + payload


def _refusal_reply(code: str, message: str) -> bytes:
    raw = code.encode("ascii", "replace")
    if not _CODE_RE.fullmatch(raw):
        raw = b"INTERNAL"
    return _reply(STATUS_REFUSED, 0, raw, message.encode("utf-8", "replace")[:MAX_PAYLOAD_BYTES])


def _peer_pid(conn: socket.socket) -> int:
    """The peer's pid from SO_PEERCRED; 0 when unknown."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, _uid, _gid = struct.unpack("3i", creds)
    except (OSError, struct.error):
        return 0
    return max(pid, 0)


def _check_path(path: str) -> None:
    if len(os.fsencode(path)) > _UNIX_PATH_MAX:
        raise errors.InvalidArgument(
            f"handoff socket path {path!r} is longer than {_UNIX_PATH_MAX} bytes (a unix socket's limit)",
            field="path",
        )


class HandoffServer:
    """Serves grants at ``path`` (a unix stream socket, mode 0600): ``grant(token, peer_pid)``
    returns the Grant for each request, or raises ExpertCacheError to refuse it (its code and
    message go back to the client). The socket exists once the constructor returns; ``start``
    accepts, ``close`` stops."""

    def __init__(
        self,
        path: str,
        grant: Callable[[bytes, int], Grant],
        *,
        timeout_s: float = 2.0,
        max_connections: int = 16,
    ) -> None:
        path = os.fspath(path)
        if not timeout_s > 0:
            raise errors.InvalidArgument(f"timeout_s must be > 0, got {timeout_s!r}", field="timeout_s")
        if not isinstance(max_connections, int) or max_connections < 1:
            raise errors.InvalidArgument(
                f"max_connections must be an integer >= 1, got {max_connections!r}", field="max_connections"
            )
        _check_path(path)
        self._path = path
        self._grant = grant
        self._timeout_s = float(timeout_s)
        self._max_connections = max_connections
        self._log = RateLimitedLog(log, REFUSAL_LOG_INTERVAL_S)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified as connections finish
        # Admitted, not yet closed → whether its reply is going out (it then no longer counts).
        self._active: dict[socket.socket, bool] = {}
        self._closing = threading.Event()  # close() began
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=max_connections, thread_name_prefix="handoff")
        self._sock, self._identity = self._listen(path, backlog=min(socket.SOMAXCONN, 2 * max_connections))
        self._wake_r, self._wake_w = os.pipe()

    @property
    def path(self) -> str:
        return self._path

    @staticmethod
    def _listen(path: str, backlog: int) -> tuple[socket.socket, tuple[int, int]]:
        """A listening socket at ``path``: bound to a temporary name beside it, made 0600 before
        it listens (nobody can connect in between), then renamed over ``path``. An existing
        socket at ``path`` is replaced; anything else there is refused."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(st.st_mode):
                raise errors.FailedPrecondition(
                    f"handoff socket path {path} exists and is not a socket; not replacing it"
                )
        # A temporary name in the same directory no longer than the final one (a path that
        # fits fits its temporary too), random so that two servers never share it.
        directory = os.path.dirname(path)
        length = max(6, len(os.path.basename(path)) - 1)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            for attempt in range(8):
                tmp = os.path.join(directory, "." + secrets.token_hex(length)[:length])
                _check_path(tmp)
                try:
                    sock.bind(tmp)
                    break
                except OSError as exc:
                    if exc.errno != errno.EADDRINUSE or attempt == 7:
                        raise
            try:
                os.chmod(tmp, 0o600)
                sock.listen(backlog)
                os.rename(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            st = os.stat(path)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock, (st.st_dev, st.st_ino)

    def start(self) -> None:
        """Accept on a daemon thread."""
        with self._lock:
            if self._closing.is_set():
                raise errors.FailedPrecondition(f"handoff server at {self._path} is closed")
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._accept_loop, name=f"handoff-accept {self._path}", daemon=True
            )
        self._thread.start()

    def close(self) -> None:
        """Stop accepting, cut connections still sending their request, wait (up to timeout_s)
        for those being answered, remove the socket file (if it is still this server's).
        Idempotent."""
        with self._lock:
            if self._closing.is_set():
                return  # set here only, under the lock: closed already
            self._closing.set()  # from here on no connection is admitted
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(self._timeout_s)
        self._sock.close()
        self._remove_socket_file()
        # A reader waiting for its request sees EOF; a reply can still go out. Under the lock: a
        # handler closes its socket only after taking it out of _active.
        self._shutdown_active(socket.SHUT_RD)
        deadline = time.monotonic() + self._timeout_s
        with self._idle:
            while self._active:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._idle.wait(remaining)
        self._shutdown_active(socket.SHUT_RDWR)  # those still busy past timeout_s
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._thread is None or not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _shutdown_active(self, how: int) -> None:
        with self._lock:
            for conn in self._active:
                try:
                    conn.shutdown(how)
                except OSError:
                    pass

    def _remove_socket_file(self) -> None:
        try:
            st = os.lstat(self._path)
            if (st.st_dev, st.st_ino) == self._identity:
                os.unlink(self._path)
        except OSError:
            pass

    # -- accepting -------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        backoff = _ACCEPT_BACKOFF_S[0]
        with selectors.DefaultSelector() as selector:
            selector.register(self._sock, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while not self._closing.is_set():
                try:
                    selector.select()
                    if self._closing.is_set():
                        break
                    conn, _ = self._sock.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                except Exception as exc:  # EMFILE, ENFILE, ENOBUFS, ...: wait, then try again
                    if self._closing.is_set():
                        break
                    self._log.log(
                        logging.WARNING,
                        "accept",
                        "handoff at %s: accept failed (%s); retrying",
                        self._path,
                        exc,
                    )
                    self._closing.wait(backoff)
                    backoff = min(2 * backoff, _ACCEPT_BACKOFF_S[1])
                    continue
                backoff = _ACCEPT_BACKOFF_S[0]
                try:
                    self._admit(conn)
                except Exception as exc:  # never lets a connection end the loop
                    conn.close()
                    self._log.log(
                        logging.WARNING, "admit", "handoff at %s: dropped a connection: %s", self._path, exc
                    )

    def _admit(self, conn: socket.socket) -> None:
        with self._lock:
            busy = sum(1 for replying in self._active.values() if not replying)
            full = self._closing.is_set() or busy >= self._max_connections
            if not full:
                self._active[conn] = False
        if full:
            self._refuse_now(conn)
            return
        try:
            self._pool.submit(self._serve, conn)
        except RuntimeError:  # the pool is shut down: closing
            self._finish(conn)

    def _refuse_now(self, conn: socket.socket) -> None:
        """Refuse a connection beyond max_connections without blocking the accept thread."""
        try:
            conn.setblocking(False)
            conn.send(
                _refusal_reply(
                    errors.ResourceExhausted.grpc_code,
                    f"handoff at {self._path} is serving {self._max_connections} connections "
                    "(max_connections); try again",
                )
            )
        except OSError:
            pass
        finally:
            conn.close()
        if not self._closing.is_set():
            self._log.log(
                logging.WARNING,
                "max_connections",
                "handoff at %s: refused a connection, %d already open (max_connections)",
                self._path,
                self._max_connections,
            )

    def _release_slot(self, conn: socket.socket) -> None:
        """``conn``'s reply is about to go out: it no longer counts against max_connections.
        Released before the send, so that a client that connects again as soon as it has its
        reply never finds its own previous connection still counted (the handler may close
        its descriptors and socket later than that). A pool thread still serves ``conn`` until
        ``_finish``, so at most 2 * max_connections sockets are open at once."""
        with self._lock:
            if conn in self._active:
                self._active[conn] = True

    def _finish(self, conn: socket.socket) -> None:
        with self._idle:
            self._active.pop(conn, None)
            self._idle.notify_all()
        conn.close()

    # -- one connection --------------------------------------------------------------------

    def _serve(self, conn: socket.socket) -> None:
        pid = 0
        received: list[int] = []  # descriptors a client sent: never used, always closed
        try:
            pid = _peer_pid(conn)
            try:
                token = self._read_request(conn, received)
                self._answer(conn, token, pid)
            except _Refusal as refusal:
                self._send_refusal(conn, refusal, pid)
        except Exception as exc:
            self._log.log(
                logging.WARNING,
                "handler",
                "handoff at %s: connection from pid %d failed: %s",
                self._path,
                pid,
                exc,
                exc_info=True,
            )
        finally:
            _close_fds(received)
            self._finish(conn)

    def _read_request(self, conn: socket.socket, received: list[int]) -> bytes:
        deadline = time.monotonic() + self._timeout_s

        def read(n: int) -> bytes:
            try:
                data = _recv_exact(conn, n, deadline, received, max_fds=1)
            except _Truncated:
                data = b""  # more than one descriptor came (the rest were dropped by the kernel)
            if received or not data:
                raise _Refusal(
                    errors.InvalidArgument.grpc_code,
                    "a handoff request carries no file descriptors",
                    "descriptors in a request",
                )
            return data

        try:
            magic = read(len(REQUEST_MAGIC))
            if magic[:3] != REQUEST_MAGIC[:3]:
                raise _Refusal(errors.InvalidArgument.grpc_code, "not a handoff request", "not a request")
            if magic[3] != WIRE_VERSION:
                raise _Refusal(
                    errors.InvalidArgument.grpc_code,
                    f"handoff wire version {magic[3]} is not supported (this server speaks {WIRE_VERSION})",
                    "wire version",
                )
            token = read(HANDOFF_TOKEN_BYTES)
        except TimeoutError:
            raise _Refusal(
                errors.DeadlineExceeded.grpc_code,
                f"no complete handoff request within {self._timeout_s}s",
                "timeout",
            ) from None
        except (EOFError, ConnectionError) as exc:
            if self._closing.is_set():  # close() cut the read (SHUT_RD), not the client
                raise _Refusal(
                    errors.Unavailable.grpc_code, f"handoff server at {self._path} is closing", ""
                ) from None
            raise _Refusal(
                errors.InvalidArgument.grpc_code,
                f"handoff request cut short ({exc}); a request is {REQUEST_BYTES} bytes",
                "short request",
            ) from None
        try:  # anything after the request is a client that does not speak this protocol
            conn.settimeout(0)  # non-blocking: with a timeout, Python would poll for it first
            extra = conn.recv(1, socket.MSG_PEEK)
        except OSError:  # BlockingIOError: nothing more (the well-behaved case)
            extra = b""
        if extra:
            raise _Refusal(
                errors.InvalidArgument.grpc_code,
                f"handoff request longer than {REQUEST_BYTES} bytes",
                "long request",
            )
        return token

    def _answer(self, conn: socket.socket, token: bytes, pid: int) -> None:
        try:
            grant = self._grant(token, pid)
        except errors.ExpertCacheError as exc:
            raise _Refusal(exc.grpc_code, str(exc), f"refused {exc.grpc_code}") from None
        except Exception as exc:
            self._log.log(
                logging.WARNING,
                "grant failed",
                "handoff at %s: the grant callback failed for pid %d: %s",
                self._path,
                pid,
                exc,
                exc_info=True,
            )
            raise _Refusal("INTERNAL", "the handoff grant failed", "") from None
        try:
            fds = list(grant.fds) if isinstance(grant, Grant) else []
        except TypeError:  # not a sequence: nothing this server can close
            fds = []
        try:
            problem = self._invalid(grant, fds)
            if problem:
                self._log.log(
                    logging.WARNING,
                    "invalid grant",
                    "handoff at %s: the grant callback returned an invalid grant: %s",
                    self._path,
                    problem,
                )
                raise _Refusal("INTERNAL", "the handoff grant failed", "")
            payload = bytes(grant.payload)
            message = _reply(STATUS_GRANTED, len(fds), b"", payload)
            conn.settimeout(self._timeout_s)
            self._release_slot(conn)
            try:
                if fds:
                    sent = conn.sendmsg(
                        [message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                    )
                else:
                    sent = conn.send(message)
                if sent < len(message):
                    conn.sendall(message[sent:])
            except OSError as exc:
                self._log.log(
                    logging.WARNING,
                    "send",
                    "handoff at %s: could not send the grant to pid %d: %s",
                    self._path,
                    pid,
                    exc,
                )
        finally:
            _close_fds(fds)

    @staticmethod
    def _invalid(grant: object, fds: list) -> str:
        """What is wrong with ``grant`` (empty when nothing)."""
        if not isinstance(grant, Grant):
            return f"expected a Grant, got {type(grant).__name__}"
        if not isinstance(grant.payload, (bytes, bytearray, memoryview)):
            return f"payload is {type(grant.payload).__name__}, not bytes"
        if len(bytes(grant.payload)) > MAX_PAYLOAD_BYTES:
            return f"payload of {len(bytes(grant.payload))} bytes (at most {MAX_PAYLOAD_BYTES})"
        if len(fds) > MAX_GRANT_FDS:
            return f"{len(fds)} fds (at most {MAX_GRANT_FDS})"
        if not all(isinstance(fd, int) and not isinstance(fd, bool) and fd >= 0 for fd in fds):
            return "fds must be non-negative integers"
        return ""

    def _send_refusal(self, conn: socket.socket, refusal: _Refusal, pid: int) -> None:
        if refusal.kind and not self._closing.is_set():
            self._log.log(
                logging.WARNING,
                refusal.kind,
                "handoff at %s: refused pid %d (%s): %s",
                self._path,
                pid,
                refusal.code,
                refusal.message,
            )
        self._release_slot(conn)
        try:
            conn.settimeout(0)  # a reply is small: it goes out now or not at all
            conn.send(_refusal_reply(refusal.code, refusal.message))
        except OSError:
            pass


def receive(path: str, token: bytes, *, timeout_s: float = 5.0) -> tuple[bytes, list[int]]:
    """Ask the handoff server at ``path`` for the grant of ``token``: (payload, fds), the fds
    close-on-exec and the caller's to close.

    Raises Unavailable (the daemon cannot be reached at ``path``, the connection broke, no
    reply within ``timeout_s``, or the reply broke the wire format), the ExpertCacheError of the
    code the server refused with (FailedPrecondition, ...: the server's message), or
    InvalidArgument for a token that is not HANDOFF_TOKEN_BYTES bytes."""
    path = os.fspath(path)
    if not isinstance(token, (bytes, bytearray, memoryview)) or len(bytes(token)) != HANDOFF_TOKEN_BYTES:
        raise errors.InvalidArgument(f"a handoff token is {HANDOFF_TOKEN_BYTES} bytes", field="token")
    if not timeout_s > 0:
        raise errors.InvalidArgument(f"timeout_s must be > 0, got {timeout_s!r}", field="timeout_s")
    where = f"cache daemon's handoff socket {path}"
    deadline = time.monotonic() + timeout_s
    fds: list[int] = []
    granted = False
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.settimeout(timeout_s)
            sock.connect(path)
        except OSError as exc:
            raise errors.Unavailable(f"{where} cannot be reached: {exc.strerror or exc}") from None
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.sendall(REQUEST_MAGIC + bytes(token))
        except (BrokenPipeError, ConnectionResetError):
            pass  # a server that refused at once has closed; its reply may still be queued
        header = _recv_exact(sock, REPLY_HEADER_BYTES, deadline, fds, MAX_GRANT_FDS)
        status, nfds, code_len, payload_len = _REPLY_FIELDS.unpack(header[len(REPLY_MAGIC) :])
        if (
            header[: len(REPLY_MAGIC)] != REPLY_MAGIC
            or status not in (STATUS_GRANTED, STATUS_REFUSED)
            or nfds > MAX_GRANT_FDS
            or code_len > MAX_CODE_BYTES
            or payload_len > MAX_PAYLOAD_BYTES
            or (status == STATUS_GRANTED and code_len)
            or (status == STATUS_REFUSED and (nfds or not code_len))
        ):
            raise errors.Unavailable(f"{where} sent a malformed reply header")
        body = _recv_exact(sock, code_len + payload_len, deadline, fds, MAX_GRANT_FDS)
        code, payload = body[:code_len], body[code_len:]
        if len(fds) != nfds:
            raise errors.Unavailable(f"{where} sent {len(fds)} file descriptors, its reply said {nfds}")
        if status == STATUS_REFUSED:
            if not _CODE_RE.fullmatch(code):
                raise errors.Unavailable(f"{where} sent a malformed status code")
            name = code.decode("ascii")
            message = payload.decode("utf-8", "replace")
            cls = _CODE_ERRORS.get(name)
            if cls is None:
                raise errors.ExpertCacheError(f"{where} refused the handoff with {name}: {message}")
            raise cls(message)
        granted = True
        return payload, fds
    except TimeoutError:
        raise errors.Unavailable(f"{where}: no reply within {timeout_s}s") from None
    except _Truncated:
        raise errors.Unavailable(f"{where} sent more than {MAX_GRANT_FDS} file descriptors") from None
    except EOFError:
        raise errors.Unavailable(f"{where} closed the connection before its reply was complete") from None
    except OSError as exc:
        raise errors.Unavailable(f"{where}: connection failed: {exc.strerror or exc}") from None
    finally:
        sock.close()
        if not granted:
            _close_fds(fds)
