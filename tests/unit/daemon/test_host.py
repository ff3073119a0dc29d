"""The host tier on the native HostPool: LRU and pins, 4 KiB-aligned slot views that the store
reads into with O_DIRECT, pool exhaustion, and page-locking (or its logged fallback)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from cache_daemon.decisions.policy import make_policy
from cache_daemon.errors import ChecksumMismatch
from cache_daemon.metrics import DaemonMetrics
from cache_daemon.tiers import HostTier, StoreReader
from cache_daemon.tiers.host import StagingBuffer, make_host_pool, pool_slots
from cache_daemon.tiers.store import IO_MODE_PREAD, IO_MODE_URING
from expertcache import native
from expertcache.keys import ExpertKey
from expertcache.prom import value
from tests.stores import blob_of, supports_o_direct, write_store

BLOB = 4096


def blob(value: int, nbytes: int = BLOB) -> torch.Tensor:
    return torch.full((nbytes,), value, dtype=torch.uint8)


def test_host_tier_lru_and_pins():
    metrics = DaemonMetrics()
    host = HostTier(2, BLOB, make_policy("lru"), metrics)
    a, b, c = ExpertKey(1, 0), ExpertKey(1, 1), ExpertKey(1, 2)
    assert host.put(a, blob(1)) and host.put(b, blob(2))
    assert host.pin(a)  # a is pinned and now the most recent
    assert host.put(c, blob(3))  # evicts b (a is pinned)
    assert host.contains(a) and not host.contains(b) and host.contains(c)
    assert int(host.get(a)[0]) == 1 and host.get(a).data_ptr() % 4096 == 0
    assert host.pin_count(a) == 1
    assert not host.remove(a)  # pinned
    assert host.pin(c)
    assert not host.put(b, blob(2))  # every slot pinned: no room, no wait
    host.unpin(a)
    host.unpin(c)
    assert host.put(b, blob(2))  # evicts a, the least recently used
    assert not host.contains(a)
    assert value(metrics.evictions, "host") == 2
    assert value(metrics.bytes_in, "host") == 4 * BLOB
    assert host.resident_count() == 2
    with pytest.raises(ValueError, match="not pinned"):
        host.unpin(b)
    with pytest.raises(ValueError, match="without a pin"):
        host.get(b)
    assert host.remove(b) and host.resident_count() == 1
    host.close()


def test_pins_are_counted():
    host = HostTier(1, BLOB, make_policy("lru"), DaemonMetrics())
    key = ExpertKey(2, 3)
    assert not host.pin(key)  # absent: nothing pinned
    assert host.pin_count(key) == 0
    view = host.put_from(key, lambda v: v.fill_(5))  # the pinning put: one pin for the caller
    assert view is not None and host.pin_count(key) == 1
    assert host.pin(key) and host.pin(key) and host.pin_count(key) == 3
    again = host.put_from(key, lambda v: pytest.fail("a present key is not filled again"))
    assert again is not None and again.data_ptr() == view.data_ptr() and host.pin_count(key) == 4
    for left in (3, 2, 1):
        host.unpin(key)
        assert host.pin_count(key) == left and not host.remove(key)
    host.unpin(key)
    assert host.pin_count(key) == 0 and host.remove(key) and not host.contains(key)
    host.close()


def test_host_tier_failed_fill_frees_the_slot():
    host = HostTier(1, BLOB, make_policy("lru"), DaemonMetrics())
    key = ExpertKey(1, 0)

    def fail(_view):
        raise ChecksumMismatch("bad blob")

    with pytest.raises(ChecksumMismatch):
        host.put_from(key, fail)
    assert not host.contains(key)
    view = host.put_from(key, lambda v: v.fill_(7))  # the slot is free again
    assert view is not None and int(view[0]) == 7 and host.pin_count(key) == 1
    host.unpin(key)
    host.close()


def test_disabled_host_tier():
    host = HostTier(0, BLOB, make_policy("lru"), DaemonMetrics())
    assert not host.enabled and not host.pinned_memory
    assert host.put_from(ExpertKey(1, 0), lambda v: None) is None
    assert not host.put(ExpertKey(1, 0), blob(1))
    with pytest.raises(ValueError, match="num_slots must be >= 0, got -1"):
        HostTier(-1, BLOB, make_policy("lru"), DaemonMetrics())


@pytest.mark.parametrize(
    "blob_bytes", [BLOB, 3 * BLOB, 5000], ids=["one_page", "three_pages", "unaligned_size"]
)
def test_every_slot_view_is_4k_aligned_and_disjoint(blob_bytes):
    slots = 4
    host = HostTier(slots, blob_bytes, make_policy("lru"), DaemonMetrics())
    views = {}
    for e in range(slots):
        key = ExpertKey(1, e)
        view = host.put_from(key, lambda v, e=e: v.fill_(e + 1))
        assert view is not None
        assert view.shape == (blob_bytes,) and view.dtype == torch.uint8 and view.is_contiguous()
        assert view.data_ptr() % 4096 == 0  # O_DIRECT can land in it without a bounce buffer
        views[key] = view
    starts = sorted(v.data_ptr() for v in views.values())
    stride = -(-blob_bytes // 4096) * 4096
    assert [b - a for a, b in zip(starts, starts[1:], strict=False)] == [stride] * (
        slots - 1
    )  # one allocation
    for e, key in enumerate(views):
        assert torch.equal(host.get(key), blob(e + 1, blob_bytes))  # no slot overlaps another
        host.unpin(key)
    host.close()


def test_pool_exhaustion_returns_none_and_recovers():
    """Every slot pinned or being filled: puts fail fast (None / False); unpinning frees room."""
    host = HostTier(2, BLOB, make_policy("lru"), DaemonMetrics())
    a, b, c = ExpertKey(1, 0), ExpertKey(1, 1), ExpertKey(1, 2)
    assert host.put_from(a, lambda v: v.fill_(1)) is not None  # pinned by the caller
    inner: list = []

    def fill_b(view):
        # While b's slot is being filled it is neither free nor evictable: c finds no room.
        inner.append(host.put_from(c, lambda v: pytest.fail("no slot should be handed out")))
        inner.append(host.put(c, blob(3)))
        view.fill_(2)

    assert host.put_from(b, fill_b) is not None
    assert inner == [None, False]
    assert not host.contains(c) and host.resident_count() == 2
    host.unpin(b)
    assert host.put(c, blob(3)) and not host.contains(b)  # b was the one unpinned key
    host.unpin(a)
    host.close()
    assert not host.enabled and host.put_from(a, lambda v: None) is None  # closed: no room, no error


def test_concurrent_puts_of_one_key_publish_once():
    host = HostTier(2, BLOB, make_policy("lru"), DaemonMetrics())
    key = ExpertKey(3, 3)
    entered, release = threading.Event(), threading.Event()
    results = []

    def slow_fill(view):
        entered.set()
        release.wait(5)
        view.fill_(9)

    t = threading.Thread(target=lambda: results.append(host.put_from(key, slow_fill)))
    t.start()
    assert entered.wait(5)
    fast = host.put_from(key, lambda v: v.fill_(9))  # publishes first, in the other slot
    release.set()
    t.join(5)
    assert fast is not None and results[0] is not None
    assert results[0].data_ptr() == fast.data_ptr()  # the slower fill's slot went back
    assert host.pin_count(key) == 2 and host.resident_count() == 1
    host.unpin(key)
    host.unpin(key)
    host.close()


def test_store_reads_land_in_host_slots_directly(tmp_path):
    root = tmp_path / "store"
    manifest = write_store(root)
    if not supports_o_direct(root):
        pytest.skip("the filesystem of tmp_path refuses O_DIRECT")
    reader = StoreReader(root, manifest, DaemonMetrics())
    assert reader.io_mode in (IO_MODE_PREAD, IO_MODE_URING)
    host = HostTier(2, manifest.blob_bytes, make_policy("lru"), DaemonMetrics())
    for key in (ExpertKey(1, 4), ExpertKey(3, 0)):
        view = host.put_from(key, lambda buf, key=key: reader.read_into(key, buf))
        assert view is not None and view.data_ptr() % 4096 == 0
        assert bytes(view.numpy()) == blob_of(root, manifest, key)
        host.unpin(key)
    assert reader.io_mode in (IO_MODE_PREAD, IO_MODE_URING)  # no fallback to buffered reads
    reader.close()
    host.close()


def test_pinning_when_cuda_is_usable_else_a_logged_fallback(caplog):
    caplog.set_level(logging.WARNING, logger="cache_daemon.tiers.host")
    host = HostTier(2, BLOB, make_policy("lru"), DaemonMetrics(), pin_memory=True)
    try:
        assert host.put(ExpertKey(1, 0), blob(4))  # works pinned or not
        if native.cuda_available():
            assert host.pinned_memory and not caplog.records
        else:
            assert not host.pinned_memory
            (record,) = caplog.records
            message = record.getMessage()
            assert "host tier: 2 x 4096 bytes left pageable" in message
            assert "cannot pin host memory" in message  # the native reason, verbatim
            assert "memlock" in message
    finally:
        host.close()
    unpinned = HostTier(1, BLOB, make_policy("lru"), DaemonMetrics())  # not asked: never pinned
    assert not unpinned.pinned_memory
    unpinned.close()


def test_pool_helpers():
    pool = make_host_pool(3, 5000, pin=False, what="test")
    assert (pool.num_slots, pool.slot_bytes, pool.stride, pool.pinned) == (3, 5000, 8192, False)
    slots = pool_slots(pool)
    assert slots.shape == (3, 5000) and slots.stride() == (8192, 1)
    assert slots[2].data_ptr() == pool.slot_address(2)
    del pool
    slots[2].fill_(1)  # the view keeps the pool (and its memory) alive
    assert int(slots[2].sum()) == 5000
    staging = StagingBuffer(BLOB, pin=False)
    assert staging.tensor.shape == (BLOB,) and staging.tensor.data_ptr() % 4096 == 0
    assert not staging.pinned
