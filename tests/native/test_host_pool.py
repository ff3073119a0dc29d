from __future__ import annotations

import gc

import pytest

from expertcache.native import HostPool


def test_alloc_until_exhausted_then_free_and_reuse():
    pool = HostPool(3, 1000)
    got = [pool.alloc() for _ in range(3)]
    assert sorted(got) == [0, 1, 2]
    assert pool.num_free == 0
    with pytest.raises(RuntimeError, match="host pool exhausted: all 3 slots in use"):
        pool.alloc()
    pool.free(1)
    assert pool.num_free == 1
    assert pool.alloc() == 1


def test_double_free_raises():
    pool = HostPool(2, 64)
    i = pool.alloc()
    pool.free(i)
    with pytest.raises(ValueError, match="double free"):
        pool.free(i)
    with pytest.raises(ValueError, match="double free"):
        pool.free(1 - i)  # never allocated


@pytest.mark.parametrize("index", [-1, 2, 10**6])
def test_out_of_range_raises(index):
    pool = HostPool(2, 64)
    with pytest.raises(IndexError, match="out of range"):
        pool.free(index)
    with pytest.raises(IndexError, match="out of range"):
        pool.view(index)


def test_bad_sizes_raise():
    with pytest.raises(ValueError):
        HostPool(0, 64)
    with pytest.raises(ValueError):
        HostPool(4, 0)


def test_slots_are_aligned_and_disjoint():
    pool = HostPool(4, 5000)
    assert pool.base_address % 4096 == 0
    assert pool.stride == 8192
    assert pool.total_bytes == 4 * 8192
    idx = [pool.alloc() for _ in range(4)]
    for i in idx:
        assert pool.slot_address(i) % 4096 == 0
        assert pool.slot_address(i) == pool.base_address + i * pool.stride
        v = pool.view(i)
        assert len(v) == 5000 and not v.readonly
        v[:] = bytes([i + 1]) * 5000
    for i in idx:
        assert bytes(pool.view(i)) == bytes([i + 1]) * 5000


def test_view_of_free_slot_raises():
    pool = HostPool(2, 64)
    with pytest.raises(ValueError, match="not allocated"):
        pool.view(0)


def test_view_keeps_pool_alive():
    pool = HostPool(1, 16)
    v = pool.view(pool.alloc())
    v[:4] = b"abcd"
    del pool
    gc.collect()
    assert bytes(v[:4]) == b"abcd"


def test_a_pool_can_be_placed_on_a_numa_node():
    # Node 0 exists on every Linux machine; the kernel records the placement policy of the mapping.
    pool = HostPool(4, 8192, numa_node=0)
    assert pool.numa_node == 0
    start = f"{pool.base_address:x} "
    (line,) = [line for line in open("/proc/self/numa_maps") if line.startswith(start)]
    assert " prefer:0" in line or " prefer (many):0" in line
    assert HostPool(2, 4096).numa_node == -1


def test_a_numa_node_that_does_not_exist_is_refused_by_name():
    with pytest.raises(RuntimeError, match=r"host pool: mbind to NUMA node 1023: Invalid argument"):
        HostPool(2, 4096, numa_node=1023)
    with pytest.raises(ValueError, match=r"NUMA node 5000 out of range"):
        HostPool(2, 4096, numa_node=5000)
