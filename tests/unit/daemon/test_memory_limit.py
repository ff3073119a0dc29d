"""The daemon refuses, at start, host memory that cannot fit in its container's memory limit."""

from __future__ import annotations

import logging

import pytest

from cache_daemon import daemon as daemon_module
from cache_daemon.config import DaemonConfig
from cache_daemon.daemon import CacheDaemon
from cache_daemon.errors import BudgetTooSmall
from cache_daemon.memory_limit import cgroup_memory_limit, check_host_memory
from expertcache import memfd
from tests.stores import write_store

BLOB = 4096


def write_cgroup_v2(tmp_path, path: str, limits: dict[str, str]):
    (tmp_path / "proc").mkdir(exist_ok=True)
    (tmp_path / "proc" / "cgroup").write_text(f"0::{path}\n")
    root = tmp_path / "cg"
    for rel, value in limits.items():
        d = root / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.max").write_text(value + "\n")
    return tmp_path / "proc" / "cgroup", root


def test_cgroup_v2_takes_the_smallest_limit_up_to_the_root(tmp_path):
    # The pod's limit sits on a parent of the container's cgroup.
    proc, root = write_cgroup_v2(
        tmp_path,
        "/kubepods/pod1/ctr",
        {"kubepods/pod1/ctr": "max", "kubepods/pod1": "8589934592", "kubepods": "max"},
    )
    assert cgroup_memory_limit(proc, root) == 8 << 30


def test_cgroup_v2_without_a_limit(tmp_path):
    proc, root = write_cgroup_v2(tmp_path, "/", {".": "max"})
    assert cgroup_memory_limit(proc, root) is None


def test_cgroup_v1_memory_controller(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("5:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n")
    (tmp_path / "cg" / "memory" / "docker" / "abc").mkdir(parents=True)
    (tmp_path / "cg" / "memory" / "docker" / "abc" / "memory.limit_in_bytes").write_text("2147483648\n")
    assert cgroup_memory_limit(proc, tmp_path / "cg") == 2 << 30
    # Unlimited in v1 is a huge page-rounded number.
    (tmp_path / "cg" / "memory" / "docker" / "abc" / "memory.limit_in_bytes").write_text(
        "9223372036854771712\n"
    )
    assert cgroup_memory_limit(proc, tmp_path / "cg") is None


def test_no_cgroup_file_means_no_limit(tmp_path):
    assert cgroup_memory_limit(tmp_path / "missing", tmp_path) is None


def test_a_budget_over_the_limit_is_refused_naming_the_parts(caplog):
    with pytest.raises(
        BudgetTooSmall,
        match=r"host_budget_bytes=3000 \+ arena=2000 = 5000 bytes\) exceeds this container's memory limit of 4000 bytes",
    ):
        check_host_memory({"host_budget_bytes": 3000, "arena": 2000}, 4000)
    with caplog.at_level(logging.WARNING):
        check_host_memory({"host_budget_bytes": 3500}, 4000)  # 88%: fits, warned
    assert "88% of the container's memory limit" in caplog.text
    check_host_memory({"host_budget_bytes": 10**15}, None)  # no limit: nothing to check


def test_daemon_start_refuses_a_host_budget_over_the_container_limit(tmp_path, monkeypatch):
    store = tmp_path / "store"
    write_store(store)
    monkeypatch.setattr(
        daemon_module, "cgroup_memory_limit", lambda: 10 * BLOB
    )  # the store holds 12 blobs: 8 + 12 slots do not fit
    config = DaemonConfig(
        store_dir=str(store),
        device="cpu",
        device_budget_bytes=8 * BLOB,
        host_budget_bytes=60 * BLOB,
    )
    made = []  # arenas made: none, since the refusal comes before anything is allocated
    monkeypatch.setattr(memfd, "create", lambda *a: made.append(a) or pytest.fail("an arena was made"))
    with pytest.raises(
        BudgetTooSmall,
        match=r"host_budget_bytes=\d+ \+ device_budget_bytes \(CPU arena\)=\d+ = \d+ bytes\) exceeds",
    ):
        CacheDaemon.start(config)
    assert made == []
