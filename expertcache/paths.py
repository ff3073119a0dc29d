"""Default locations, one place for every service and the client: all writable without root.

- The daemon's unix socket: ``$XDG_RUNTIME_DIR/expertcache/daemon.sock`` where a per-user runtime
  directory exists (a desktop or login session), else ``<tmp>/expertcache-<uid>/daemon.sock``.
  The daemon creates that directory owner-only (``ensure_private_dir``); compute's default daemon
  address and ``expertcache stats`` name the same socket.
- The predictor's embedded EAMC file: ``$XDG_STATE_HOME/expertcache/eamc.bin``, else
  ``~/.local/state/expertcache/eamc.bin``.

Containers and the Helm chart set every path by flag; these defaults serve a person running the
services by hand. They are read from the environment once, here, when a config class is defined.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def _runtime_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
        return Path(xdg) / "expertcache"
    return Path(tempfile.gettempdir()) / f"expertcache-{os.getuid()}"


def _state_dir() -> Path:
    xdg = os.environ.get("XDG_STATE_HOME", "")
    return (Path(xdg) if xdg else Path.home() / ".local" / "state") / "expertcache"


# The longest unix socket path gRPC binds: sun_path has 108 bytes, but gRPC's bind fails from 106
# on (measured with grpcio 1.85: 105 binds, 106 and 107 give "Failed to bind to address").
MAX_UNIX_SOCKET_PATH_BYTES = 105
# The daemon's handoff socket (expertcache.handoff) sits beside its gRPC socket with this suffix,
# so the gRPC socket's path may be this much shorter at most.
HANDOFF_SOCKET_SUFFIX = ".handoff"
MAX_DAEMON_SOCKET_PATH_BYTES = MAX_UNIX_SOCKET_PATH_BYTES - len(HANDOFF_SOCKET_SUFFIX)

RUNTIME_DIR = _runtime_dir()
DEFAULT_DAEMON_SOCKET = str(RUNTIME_DIR / "daemon.sock")
DEFAULT_DAEMON_ADDRESS = f"unix://{DEFAULT_DAEMON_SOCKET}"
DEFAULT_EAMC_PATH = str(_state_dir() / "eamc.bin")


def ensure_private_dir(path: str | Path) -> Path:
    """Create ``path`` (and its parents) so that only this user can enter it; refuse a directory
    someone else owns or others may write to (in a shared /tmp another user could have made it
    first, to watch or replace our socket). Raises ``PermissionError`` naming the problem."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(
            f"{path} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): refusing it"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): refusing it"
        )
    return path
