"""The host tier: an LRU cache below the arena, a fixed pool of 4 KiB-aligned blob-sized slots in
host memory (page-locked for a CUDA arena) that the store reads into with O_DIRECT
(docs/residency.md, "The host tier").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cache_daemon.decisions.policy import EvictionPolicy
from cache_daemon.metrics import DaemonMetrics
from cache_daemon.tiers.base import MemoryTier, Tier
from expertcache import native
from expertcache.keys import ExpertKey

logger = logging.getLogger(__name__)


def make_host_pool(
    num_slots: int, slot_bytes: int, *, pin: bool, what: str, numa_node: int = -1
) -> native.HostPool:
    """A native ``HostPool``; page-locked when ``pin`` and possible, else pageable (logged).

    Pinning fails without a CUDA build, without a usable driver, or over the memlock limit; the
    pool still works unpinned (copies to the GPU are then staged by the driver), so that is a
    warning, not an error. ``numa_node`` >= 0 places the pool's pages on that node (the GPU's,
    on a machine with several). ``what`` names the pool in the log line.
    """
    if pin:
        try:
            return native.HostPool(num_slots, slot_bytes, pin=True, numa_node=numa_node)
        except RuntimeError as exc:
            logger.warning(
                "%s: %d x %d bytes left pageable, host->device copies will be synchronous (%s); "
                "raise the container's memlock limit to pin it",
                what,
                num_slots,
                slot_bytes,
                exc,
            )
    return native.HostPool(num_slots, slot_bytes, pin=False, numa_node=numa_node)


def pool_slots(pool: native.HostPool) -> torch.Tensor:
    """``[num_slots, slot_bytes]`` uint8 view of every slot of ``pool`` (rows ``pool.stride`` apart).

    The tensor keeps ``pool`` alive (``torch.frombuffer`` holds the buffer's owner), so the
    memory outlives every view handed out, whatever the order of release.
    """
    flat = torch.frombuffer(pool, dtype=torch.uint8, count=pool.total_bytes)  # [total_bytes] uint8
    return flat.as_strided((pool.num_slots, pool.slot_bytes), (pool.stride, 1))


class StagingBuffer:
    """A one-slot host pool: ``tensor`` is its ``[nbytes]`` uint8, 4 KiB-aligned view.

    Used where no host-tier slot is available to read the store into before a copy to the GPU.
    """

    def __init__(self, nbytes: int, *, pin: bool, numa_node: int = -1) -> None:
        self._pool = make_host_pool(1, nbytes, pin=pin, what="staging buffer", numa_node=numa_node)
        self._pool.alloc()
        self.tensor: torch.Tensor = pool_slots(self._pool)[0]  # [nbytes] uint8

    @property
    def pinned(self) -> bool:
        return bool(self._pool.pinned)


@dataclass(frozen=True, eq=False)
class HostReservation:
    """A host slot reserved for ``key`` (``HostTier.reserve``): ``view`` is its ``[blob_bytes]``
    uint8 memory; ``present``: the key was already there and ``view`` is pinned, read-only."""

    key: ExpertKey
    slot: int
    view: torch.Tensor
    present: bool
    pool: native.HostPool


class HostTier(MemoryTier):
    """LRU cache of blobs in one host allocation. See ``tiers.base`` for the ownership contract.

    ``reserve`` / ``commit`` is the zero-copy put: a slot is reserved (evicting an unpinned
    victim if needed) and handed to the caller to fill (a store read), and only the commit makes
    the key visible, pinned for the caller. A slot being filled is invisible to
    ``contains``/``pin`` and never a victim.
    """

    tier = Tier.HOST

    def __init__(
        self,
        num_slots: int,
        blob_bytes: int,
        policy: EvictionPolicy,
        metrics: DaemonMetrics,
        *,
        pin_memory: bool = False,
        numa_node: int = -1,
    ) -> None:
        """``pin_memory``: try to page-lock the pool (wanted when it feeds a CUDA arena);
        ``pinned_memory`` tells whether it was. ``numa_node``: where its pages go (-1: anywhere)."""
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self.limit = num_slots  # slots that may be in use at once (the live host budget)
        self.blob_bytes = blob_bytes
        self._policy = policy
        self._metrics = metrics
        self._lock = threading.Lock()
        self._slot_of: dict[ExpertKey, int] = {}
        self._pins: dict[ExpertKey, int] = {}
        self._pool: native.HostPool | None = None
        self._slots: torch.Tensor | None = None  # [num_slots, blob_bytes] uint8, rows 4 KiB-aligned
        self._views: dict[int, torch.Tensor] = {}  # slot -> its row of _slots, made on first use
        if num_slots:
            self._pool = make_host_pool(
                num_slots, blob_bytes, pin=pin_memory, what="host tier", numa_node=numa_node
            )
            self._slots = pool_slots(self._pool)
        self.pinned_memory = self._pool is not None and bool(self._pool.pinned)
        if num_slots:
            logger.info(
                "host tier: %d slots x %d bytes (%s%s)",
                num_slots,
                blob_bytes,
                "pinned" if self.pinned_memory else "pageable",
                f", NUMA node {numa_node}" if numa_node >= 0 else "",
            )

    @property
    def enabled(self) -> bool:
        """False without slots, and after ``close``."""
        return self._pool is not None

    def resident_count(self) -> int:
        with self._lock:
            return len(self._slot_of)

    def pin_count(self, key: ExpertKey) -> int:
        with self._lock:
            return self._pins.get(key, 0)

    # -- MemoryTier ---------------------------------------------------------------------
    def contains(self, key: ExpertKey) -> bool:
        with self._lock:
            return key in self._slot_of

    def pin(self, key: ExpertKey) -> bool:
        with self._lock:
            if key not in self._slot_of:
                return False
            self._pins[key] = self._pins.get(key, 0) + 1
            self._policy.on_access(key)
            return True

    def pin_view(self, key: ExpertKey) -> torch.Tensor | None:
        """``pin`` and ``get`` in one hold of the lock: ``key``'s slot view, pinned, or None."""
        with self._lock:
            slot = self._slot_of.get(key)
            if slot is None:
                return None
            self._pins[key] = self._pins.get(key, 0) + 1
            self._policy.on_access(key)
            view = self._views.get(slot)
            if view is None:
                assert self._slots is not None
                view = self._views[slot] = self._slots[slot]
            return view

    def unpin(self, key: ExpertKey) -> None:
        with self._lock:
            count = self._pins.get(key, 0)
            if count <= 0:
                raise ValueError(f"host tier: unpin of expert {key}, which is not pinned")
            if count == 1:
                del self._pins[key]
            else:
                self._pins[key] = count - 1

    def get(self, key: ExpertKey) -> torch.Tensor:
        """``[blob_bytes]`` uint8 view of ``key``'s host slot; valid only while the caller pins it."""
        with self._lock:
            if self._pins.get(key, 0) <= 0:
                raise ValueError(f"host tier: get of expert {key} without a pin")
            assert self._slots is not None
            slot = self._slot_of[key]
            view = self._views.get(slot)
            if view is None:  # made once per slot: a tensor view costs microseconds at every load
                view = self._views[slot] = self._slots[slot]
            return view

    def put(self, key: ExpertKey, data: torch.Tensor) -> bool:
        view = self.put_from(key, lambda slot: slot.copy_(data.reshape(-1)))
        if view is None:
            return False
        self.unpin(key)
        return True

    def reserve(self, key: ExpertKey) -> HostReservation | None:
        """The first half of a zero-copy put: a slot for ``key`` to fill outside any lock.

        Returns None when the tier is disabled or every slot is pinned or being filled. If ``key``
        is already present the reservation is ``present``: its ``view`` is pinned for the caller
        (``unpin`` it) and must not be written. Otherwise the caller writes the blob into
        ``view`` (a slot invisible to ``contains``/``pin``, never a victim), then ``commit``s it
        (or ``abandon``s it when the fill failed)."""
        with self._lock:
            pool, slots = self._pool, self._slots
            if pool is None or slots is None:
                return None
            if key in self._slot_of:
                self._pins[key] = self._pins.get(key, 0) + 1
                self._policy.on_access(key)
                return HostReservation(key, self._slot_of[key], slots[self._slot_of[key]], True, pool)
            slot = self._take_slot_locked()
            if slot is None:
                return None
            return HostReservation(key, slot, slots[slot], False, pool)

    def commit(self, reservation: HostReservation) -> torch.Tensor | None:
        """Publish a filled reservation: ``key`` is present and pinned for the caller (who must
        ``unpin``); returns its view, or None if the tier was closed meanwhile."""
        key, slot = reservation.key, reservation.slot
        with self._lock:
            if self._pool is not reservation.pool or self._slots is None:
                return None  # closed meanwhile: the fill landed in a dropped pool
            if key in self._slot_of:  # a concurrent put of the same key published first
                self._pool.free(slot)
                self._pins[key] = self._pins.get(key, 0) + 1
                return self._slots[self._slot_of[key]]
            self._slot_of[key] = slot
            self._pins[key] = self._pins.get(key, 0) + 1
            self._policy.on_insert(key)
        self._metrics.tier["host"].bytes_in.inc(self.blob_bytes)
        return reservation.view

    def abandon(self, reservation: HostReservation) -> None:
        """The fill of a reservation failed: its slot goes back to the free list."""
        with self._lock:
            if self._pool is reservation.pool:
                self._pool.free(reservation.slot)

    def put_from(self, key: ExpertKey, fill: Callable[[torch.Tensor], None]) -> torch.Tensor | None:
        """``reserve``, ``fill(slot_view)`` outside the lock, ``commit``: the pinned
        ``[blob_bytes]`` view (the caller must ``unpin``), or None when there is no room. A present
        key is pinned and returned without calling ``fill``; if ``fill`` raises, the slot goes back
        to the free list and the exception propagates."""
        reservation = self.reserve(key)
        if reservation is None:
            return None
        if reservation.present:
            return reservation.view
        try:
            fill(reservation.view)
        except BaseException:
            self.abandon(reservation)
            raise
        return self.commit(reservation)

    def _take_slot_locked(self) -> int | None:
        assert self._pool is not None
        # Above the limit (a shrink met pinned experts): shed unpinned ones first.
        while self._pool.num_slots - self._pool.num_free > self.limit:
            victim = self._evict_locked()
            if victim is None:
                return None
            self._pool.free(victim)
        if self._pool.num_free and self._pool.num_slots - self._pool.num_free < self.limit:
            return self._pool.alloc()  # lowest free index first
        if self.limit == 0:
            return None
        return self._evict_locked()

    def _evict_locked(self) -> int | None:
        """Evict the policy's first unpinned victim; its slot, or None when all are pinned."""
        victims = self._policy.choose_victims(1, lambda k: self._pins.get(k, 0) == 0)
        if not victims:
            return None
        victim = victims[0]
        slot = self._slot_of.pop(victim)
        self._policy.on_remove(victim)
        self._metrics.tier["host"].evictions.inc()
        return slot

    def set_limit(self, limit: int) -> int:
        """Change how many slots may be in use (the live host budget, at most ``num_slots``).
        Shrinking evicts the unpinned experts the policy ranks last until the rest fits (a
        pinned one leaves when a later put needs its slot); returns how many were evicted."""
        if not 0 <= limit <= self.num_slots:
            raise ValueError(f"host slot limit must be in [0, {self.num_slots}], got {limit}")
        evicted = 0
        with self._lock:
            self.limit = limit
            if self._pool is None:
                return 0
            excess = (self._pool.num_slots - self._pool.num_free) - limit
            if excess > 0:
                for victim in self._policy.choose_victims(excess, lambda k: self._pins.get(k, 0) == 0):
                    self._pool.free(self._slot_of.pop(victim))
                    self._policy.on_remove(victim)
                    self._metrics.tier["host"].evictions.inc()
                    evicted += 1
        return evicted

    def remove(self, key: ExpertKey) -> bool:
        with self._lock:
            if key not in self._slot_of or self._pins.get(key, 0) > 0:
                return False
            assert self._pool is not None  # close() empties _slot_of
            self._pool.free(self._slot_of.pop(key))
            self._policy.on_remove(key)
            return True

    def close(self) -> None:
        """Forget every key and drop the pool. Views handed out earlier keep the memory mapped
        (they reference the pool) until they go, so a late reader faults on nothing."""
        with self._lock:
            self._slot_of.clear()
            self._pins.clear()
            self._views.clear()
            self._slots = None
            self._pool = None
