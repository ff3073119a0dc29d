"""The container's memory limit, and whether the daemon's host memory fits in it: pinned host memory
and a CPU arena's pages cannot be reclaimed, so a budget above the cgroup's limit is refused at
start instead of getting the container OOM-killed later (``docs/daemon.md``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from cache_daemon.errors import BudgetTooSmall

logger = logging.getLogger(__name__)

# A limit this large means "no limit" (cgroup v1 reports 2^63 rounded down to the page size).
_UNLIMITED = 1 << 60
# Above this share of the limit the budget fits but leaves little for everything else (the
# process itself, torch, page cache): a warning, not an error.
WARN_SHARE = 0.8


def cgroup_memory_limit(
    proc_self_cgroup: str | Path = "/proc/self/cgroup", root: str | Path = "/sys/fs/cgroup"
) -> int | None:
    """The memory limit in bytes of the calling process's cgroup, or None when there is none."""
    try:
        lines = Path(proc_self_cgroup).read_text().splitlines()
    except OSError:
        return None
    root = Path(root)
    limits: list[int] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # cgroup v2: every ancestor's memory.max counts
            node = root / path.lstrip("/")
            while True:
                limits += _read_limit(node / "memory.max")
                if node == root or root not in node.parents:
                    break
                node = node.parent
        elif "memory" in controllers.split(","):  # cgroup v1
            limits += _read_limit(root / "memory" / path.lstrip("/") / "memory.limit_in_bytes")
            limits += _read_limit(root / "memory" / "memory.limit_in_bytes")
    limits = [n for n in limits if n < _UNLIMITED]
    return min(limits) if limits else None


def _read_limit(path: Path) -> list[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return []
    return [int(text)] if text.isdigit() else []  # "max": no limit


def check_host_memory(parts: dict[str, int], limit: int | None) -> None:
    """Refuse when the unreclaimable host memory ``parts`` (field name → bytes) exceeds ``limit``.

    ``BudgetTooSmall`` (INVALID_ARGUMENT, exit 2 at start) names every part and the limit; over
    ``WARN_SHARE`` of it is logged as a warning.
    """
    if limit is None:
        return
    total = sum(parts.values())
    listing = " + ".join(f"{name}={n}" for name, n in parts.items() if n)
    if total > limit:
        raise BudgetTooSmall(
            f"host memory the daemon would lock ({listing} = {total} bytes) exceeds this container's "
            f"memory limit of {limit} bytes (cgroup): lower host_budget_bytes (or the CPU arena's "
            "device_budget_bytes), or raise the container's memory limit"
        )
    if total > WARN_SHARE * limit:
        logger.warning(
            "host memory the daemon locks (%s = %d bytes) is %.0f%% of the container's memory limit (%d bytes): "
            "little is left for the process itself",
            listing,
            total,
            100 * total / limit,
            limit,
        )
