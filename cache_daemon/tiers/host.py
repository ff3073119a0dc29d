"""The host tier: a fixed pool of blob-sized slots in host memory, an LRU cache below the arena.

One allocation of ``num_slots × blob_bytes`` bytes, made once: an anonymous mmap, page-locked
with ``cudaHostRegister`` when CUDA is present so host→device copies are asynchronous DMA.
Every slot is page-aligned, so the store can read into it with O_DIRECT: a miss costs one
read into a host slot and one copy into the arena (DESIGN §3).

    host pool  [num_slots, blob_bytes] uint8
    key → slot   (``_slot_of``), pins per key, free slots, slots being filled (not yet visible)
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Callable

import torch

from cache_daemon.metrics import DaemonMetrics
from cache_daemon.policy import EvictionPolicy
from cache_daemon.tiers.base import MemoryTier, Tier
from expertcache.errors import FailedPrecondition
from expertcache.keys import ExpertKey

logger = logging.getLogger(__name__)

CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


class HostBuffer:
    """One page-aligned host allocation (an anonymous mmap), page-locked for CUDA when asked.

    Page-locking uses ``cudaHostRegister`` on the mmap rather than ``pin_memory=True``: torch's
    pinned allocator rounds sizes up to a power of two and caches the block, which for a host
    budget of tens of GiB would lock far more memory than configured. ``tensor`` is the
    ``[nbytes]`` uint8 view; ``close`` unregisters and unmaps (after every copy from it ended).
    """

    def __init__(self, nbytes: int, *, pin_memory: bool = False) -> None:
        self._mmap = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor: torch.Tensor = torch.frombuffer(self._mmap, dtype=torch.uint8, count=nbytes)  # [nbytes]
        self._registered: int | None = None
        if pin_memory:
            ptr = self.tensor.data_ptr()
            err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, CUDA_HOST_REGISTER_PORTABLE))
            if err != 0:
                self.close()
                raise FailedPrecondition(
                    f"cannot page-lock {nbytes} bytes of host memory (cudaError {err}): raise the "
                    "container's memlock limit or lower host_budget_bytes"
                )
            self._registered = ptr

    @property
    def pinned(self) -> bool:
        return self._registered is not None

    def close(self) -> None:
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None
        self.tensor = torch.empty(0, dtype=torch.uint8)
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes when it does


class HostTier(MemoryTier):
    """LRU cache of blobs in one host allocation. See ``tiers.base`` for the ownership contract.

    ``put_from`` is the zero-copy put: it reserves a slot (evicting an unpinned victim if
    needed), lets the caller fill it (e.g. a store read), and only then makes the key visible,
    pinned for the caller. A slot being filled is invisible to ``contains``/``pin`` and never a
    victim.
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
    ) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self.blob_bytes = blob_bytes
        self.pinned_memory = pin_memory and num_slots > 0
        self._policy = policy
        self._metrics = metrics
        self._lock = threading.Lock()
        self._slot_of: dict[ExpertKey, int] = {}
        self._pins: dict[ExpertKey, int] = {}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._buffer: HostBuffer | None = None
        self._slots: torch.Tensor | None = None  # [num_slots, blob_bytes] uint8
        if num_slots:
            self._buffer = HostBuffer(num_slots * blob_bytes, pin_memory=self.pinned_memory)
            self._slots = self._buffer.tensor.view(num_slots, blob_bytes)
            logger.info(
                "host tier: %d slots x %d bytes (%s)",
                num_slots,
                blob_bytes,
                "pinned" if self.pinned_memory else "pageable",
            )

    @property
    def enabled(self) -> bool:
        return self.num_slots > 0

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
            return self._slots[self._slot_of[key]]

    def put(self, key: ExpertKey, data: torch.Tensor) -> bool:
        view = self.put_from(key, lambda slot: slot.copy_(data.reshape(-1)))
        if view is None:
            return False
        self.unpin(key)
        return True

    def put_from(self, key: ExpertKey, fill: Callable[[torch.Tensor], None]) -> torch.Tensor | None:
        """Reserve a slot, call ``fill(slot_view)`` outside the lock, then publish ``key`` pinned.

        Returns the pinned ``[blob_bytes]`` view (the caller must ``unpin``), or None when the
        tier is disabled or every slot is pinned or being filled. If ``key`` is already present
        it is pinned and returned without calling ``fill``. If ``fill`` raises, the slot goes
        back to the free list and the exception propagates.
        """
        if not self.enabled:
            return None
        with self._lock:
            if key in self._slot_of:
                self._pins[key] = self._pins.get(key, 0) + 1
                self._policy.on_access(key)
                return self._slots[self._slot_of[key]]
            slot = self._take_slot_locked()
            if slot is None:
                return None
        assert self._slots is not None
        view = self._slots[slot]
        try:
            fill(view)
        except BaseException:
            with self._lock:
                self._free.append(slot)
            raise
        with self._lock:
            if key in self._slot_of:  # a concurrent put of the same key published first
                self._free.append(slot)
                self._pins[key] = self._pins.get(key, 0) + 1
                return self._slots[self._slot_of[key]]
            self._slot_of[key] = slot
            self._pins[key] = self._pins.get(key, 0) + 1
            self._policy.on_insert(key)
        self._metrics.bytes_in.inc(self.blob_bytes, tier=Tier.HOST.value)
        return view

    def _take_slot_locked(self) -> int | None:
        if self._free:
            return self._free.pop()
        victims = self._policy.choose_victims(1, lambda k: self._pins.get(k, 0) == 0)
        if not victims:
            return None
        victim = victims[0]
        slot = self._slot_of.pop(victim)
        self._policy.on_remove(victim)
        self._metrics.evictions.inc(tier=Tier.HOST.value)
        return slot

    def remove(self, key: ExpertKey) -> bool:
        with self._lock:
            if key not in self._slot_of or self._pins.get(key, 0) > 0:
                return False
            self._free.append(self._slot_of.pop(key))
            self._policy.on_remove(key)
            return True

    def close(self) -> None:
        with self._lock:
            self._slot_of.clear()
            self._pins.clear()
            self._slots = None
            buffer, self._buffer = self._buffer, None
        if buffer is not None:
            buffer.close()
