"""One default daemon socket for the daemon, compute and the CLI, writable without root."""

from __future__ import annotations

import os

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
