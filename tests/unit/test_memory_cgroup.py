"""``devtools.memory_cgroup``: the benchmarks' memory cgroups. The file logic on fake v1 and v2
trees; where this machine lets a real group be made (root, a memory controller), a child held to
its limit: charged from its first instruction, OOM-killed past the limit, its peak kept."""

from __future__ import annotations

import subprocess
import sys

import pytest

from devtools.memory_cgroup import PARENT, MemoryCgroup, confined_command

MIB = 1 << 20


def fake_v1(tmp_path):
    root = tmp_path / "memory"
    root.mkdir()
    (root / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    return root


def test_a_v1_group_reads_and_writes_its_files(tmp_path):
    root = fake_v1(tmp_path)
    group, note = MemoryCgroup.make("ours", v1_root=root, v2_root=tmp_path / "none")
    assert group is not None and group.version == 1 and group.path.parent == root / PARENT
    assert note == f"cgroup v1 {group.path}"
    for name, text in (
        ("memory.usage_in_bytes", "1048576\n"),
        ("memory.max_usage_in_bytes", "2097152\n"),
        ("memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"),
        ("cgroup.procs", ""),
        ("memory.stat", "cache 4096\nrss 8192\nshmem 12288\n"),
    ):
        (group.path / name).write_text(text)
    assert (group.usage_bytes, group.peak_bytes, group.oom_kills) == (MIB, 2 * MIB, 3)
    assert (group.anon_bytes, group.stat("shmem")) == (8192, 12288)
    with pytest.raises(ValueError, match="no 'swap'"):
        group.stat("swap")
    group.set_limit(5 * MIB)
    assert group.limit_bytes == 5 * MIB
    group.add(1234)
    assert group.pids() == [1234]
    for name in (
        "memory.usage_in_bytes",
        "memory.max_usage_in_bytes",
        "memory.oom_control",
        "cgroup.procs",
        "memory.stat",
    ):
        (group.path / name).unlink()
    (group.path / "memory.limit_in_bytes").unlink()
    group.remove()
    assert not group.path.exists()
    group.remove()  # gone already: nothing to do


def test_a_v2_group_enables_the_memory_controller_on_its_way_down(tmp_path):
    root = tmp_path / "unified"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("cpu\n")
    (root / PARENT).mkdir()
    (root / PARENT / "cgroup.subtree_control").write_text("memory\n")
    group, _ = MemoryCgroup.make("lru", v1_root=tmp_path / "none", v2_root=root)
    assert group is not None and group.version == 2
    assert (root / "cgroup.subtree_control").read_text() == "+memory"  # the kernel adds it to the list
    assert (root / PARENT / "cgroup.subtree_control").read_text() == "memory\n"  # already there
    (group.path / "memory.max").write_text("max\n")
    (group.path / "memory.events").write_text("low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\n")
    assert group.limit_bytes is None and group.oom_kills == 1
    assert group.peak_bytes is None  # no memory.peak before Linux 5.19
    # memory.stat figures are asked for by their v1 names (what Confinement's budget kinds use)
    (group.path / "memory.stat").write_text("anon 8192\nfile 4096\nfile_mapped 2048\nshmem 1024\n")
    assert (group.anon_bytes, group.stat("mapped_file"), group.stat("shmem")) == (8192, 2048, 1024)


def test_where_no_group_can_be_made_it_says_why(tmp_path):
    group, note = MemoryCgroup.make("ours", v1_root=tmp_path / "a", v2_root=tmp_path / "b")
    assert group is None and "no memory cgroup" in note
    root = fake_v1(tmp_path)
    root.chmod(0o500)
    try:
        group, note = MemoryCgroup.make("ours", v1_root=root, v2_root=tmp_path / "b")
        if group is None:  # (root ignores the mode)
            assert note.startswith(f"no memory cgroup: cannot make one under {root}")
    finally:
        root.chmod(0o700)


def test_a_confined_command_keeps_its_pid_and_takes_the_descriptor_limit():
    # The shell execs the command: the process started is the command itself (its pid, its exit
    # status), with the soft limit of open descriptors asked for; nothing to do: argv as it is.
    argv = [
        sys.executable,
        "-c",
        "import os, resource; print(os.getpid(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])",
    ]
    assert confined_command(argv) == argv
    proc = subprocess.Popen(confined_command(argv, open_files=77), stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.split() == [str(proc.pid), "77"]
    failing = confined_command([sys.executable, "-c", "raise SystemExit(3)"], open_files=77)
    assert subprocess.run(failing, timeout=60).returncode == 3


def _allocate(group: MemoryCgroup, mib: int) -> subprocess.CompletedProcess:
    code = f"b = bytearray({mib} << 20)\nfor i in range(0, len(b), 4096): b[i] = 1"
    return subprocess.run(group.command([sys.executable, "-c", code]), timeout=120)


def test_a_child_is_charged_from_its_start_and_held_to_the_limit(real_memory_group):
    real_memory_group.set_limit(160 * MIB)
    assert real_memory_group.limit_bytes == 160 * MIB
    assert _allocate(real_memory_group, 64).returncode == 0
    assert real_memory_group.peak_bytes >= 64 * MIB  # charged here, not where it was forked
    assert real_memory_group.oom_kills == 0
    killed = _allocate(real_memory_group, 400)
    assert killed.returncode == -9 and real_memory_group.oom_kills >= 1
    assert real_memory_group.peak_bytes <= 160 * MIB
    assert real_memory_group.pids() == []


def test_a_command_started_in_the_group_is_there_under_its_pid(real_memory_group):
    code = "import sys; print('up', flush=True); sys.stdin.read()"
    proc = subprocess.Popen(
        real_memory_group.command([sys.executable, "-c", code]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "up"
        assert real_memory_group.pids() == [proc.pid]
    finally:
        proc.stdin.close()
        proc.wait(60)
    assert real_memory_group.pids() == []
