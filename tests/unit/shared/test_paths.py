"""One default daemon socket for the daemon, compute and the CLI, writable without root."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from cache_daemon.config import DaemonConfig
from compute_svc.config import ComputeConfig
from expertcache import cli, paths


def test_the_daemon_compute_and_the_cli_agree_on_the_default_socket():
    socket = DaemonConfig().socket_path
    assert ComputeConfig().daemon_address == f"unix://{socket}"
    assert cli.build_parser().parse_args(["stats"]).daemon == f"unix://{socket}"
    assert not socket.startswith("/run/"), "the default must be writable without root"
    assert socket == str(paths.RUNTIME_DIR / "daemon.sock")


def test_private_dir_is_created_owner_only(tmp_path):
    d = paths.ensure_private_dir(tmp_path / "a" / "b")
    assert d.is_dir() and (d.stat().st_mode & 0o777) == 0o700


def test_a_dir_others_may_write_to_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(PermissionError, match=r"is writable by other users \(mode 777\): refusing it"):
        paths.ensure_private_dir(shared)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to create a directory owned by another user")
def test_a_dir_another_user_owns_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(PermissionError, match=r"belongs to uid 12345, not to this user"):
        paths.ensure_private_dir(theirs)


def _socket_path_of(root, length: int) -> str:
    base = str(root) + "/"
    return base + "s" * (length - len(os.fsencode(base)))


def test_grpc_binds_a_socket_path_of_the_longest_length_the_daemon_accepts(tmp_path):
    """The daemon's config refuses longer socket paths than MAX_UNIX_SOCKET_PATH_BYTES: gRPC
    itself must bind that length, and one byte more must really fail (else the bound is wrong)."""
    from concurrent import futures

    import grpc

    root = tmp_path if len(os.fsencode(str(tmp_path))) < 60 else Path(tempfile.mkdtemp(prefix="s-"))
    for length, binds in (
        (paths.MAX_UNIX_SOCKET_PATH_BYTES, True),
        (paths.MAX_UNIX_SOCKET_PATH_BYTES + 1, False),
    ):
        server = grpc.server(futures.ThreadPoolExecutor(1))
        try:
            if binds:
                server.add_insecure_port(f"unix://{_socket_path_of(root, length)}")
            else:
                with pytest.raises(RuntimeError):
                    server.add_insecure_port(f"unix://{_socket_path_of(root, length)}")
        finally:
            server.stop(0)


def test_launch_moves_a_socket_too_deep_for_grpc_to_a_private_runtime_dir(tmp_path):
    from devtools.launch import daemon_socket_path

    assert daemon_socket_path(tmp_path) == tmp_path / "daemon.sock"
    deep = tmp_path / ("d" * 120)
    sock = daemon_socket_path(deep)
    assert len(os.fsencode(str(sock))) <= paths.MAX_DAEMON_SOCKET_PATH_BYTES
    assert sock.name == "daemon.sock" and sock.parent.parent == paths.RUNTIME_DIR
    assert (sock.parent.stat().st_mode & 0o777) == 0o700
    sock.parent.rmdir()


def test_a_daemon_started_in_a_deep_dir_serves_and_its_socket_dir_goes_with_it(tiny_store, tmp_path):
    from devtools.launch import start_daemon

    tiny = tiny_store("mixtral")
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    daemon = start_daemon(tiny.store, deep, device="cpu", device_budget_bytes=tiny.manifest.blob_bytes * 8)
    sock_dir = daemon.owned_dir
    try:
        assert sock_dir is not None and daemon.address == f"unix://{sock_dir / 'daemon.sock'}"
        assert (sock_dir / "daemon.sock").exists() and (deep / "daemon.log").exists()
    finally:
        assert daemon.stop() == 0
    assert not sock_dir.exists()
