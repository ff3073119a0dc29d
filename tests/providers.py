"""An in-process stand-in for the cache daemon, for tests of compute's engine without a daemon
process (the ``local_engine`` fixture, the layer-ahead tests, the CUDA tests)."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

from compute_svc.experts.moe import ExpertProvider, ReadyExpert
from expertcache.keys import ExpertKey
from expertcache.manifest import StoreManifest
from expertcache.protocol import Tier


class LocalProvider(ExpertProvider):
    """An in-process stand-in for the cache daemon over a real store (unit tests only).

    LRU over ``arena.num_slots`` slots, blobs read from the store files, pins honoured.
    Each acquire yields, as a daemon client does, the resident experts as one batch, then each
    loaded one as a batch of its own; ``reverse=True`` answers in reverse order, one expert per
    batch, to exercise reordered execution.
    """

    def __init__(self, store: Path, manifest: StoreManifest, arena, *, reverse: bool = False) -> None:
        self.store = Path(store)
        self.manifest = manifest
        self.arena = arena
        self.reverse = reverse
        self.lru: OrderedDict = OrderedDict()  # ExpertKey -> slot
        self.pins: dict = {}  # ExpertKey -> count
        self.acquires: list[tuple[int, tuple[int, ...]]] = []
        self.loads = 0

    @property
    def num_slots(self) -> int:
        return self.arena.num_slots

    def acquire(self, layer, experts, deadline=None, trace_context=None):
        for batch in self.acquire_batches(layer, experts, deadline, trace_context):
            yield from batch

    def acquire_batches(self, layer, experts, deadline=None, trace_context=None):  # noqa: ARG002 - nothing waits
        experts = tuple(experts)
        assert len(experts) <= self.num_slots, "compute must split a layer into waves of <= num_slots"
        self.acquires.append((layer, experts))
        hits = [] if self.reverse else [e for e in experts if ExpertKey(layer, e) in self.lru]
        if hits:
            for expert in hits:
                key = ExpertKey(layer, expert)
                self.lru.move_to_end(key)
                self.pins[key] = self.pins.get(key, 0) + 1
            yield [ReadyExpert(e, self.lru[ExpertKey(layer, e)], Tier.DEVICE) for e in hits]
        for expert in reversed(experts) if self.reverse else experts:
            if expert in hits:
                continue
            key = ExpertKey(layer, expert)
            if key in self.lru:
                self.lru.move_to_end(key)
                source = Tier.DEVICE
            else:
                used = set(self.lru.values())
                free = [s for s in range(self.num_slots) if s not in used]
                if free:
                    slot = free[0]
                else:
                    victim = next(k for k in self.lru if not self.pins.get(k))
                    slot = self.lru.pop(victim)
                path, offset = self.manifest.blob_location(key)
                with open(self.store / path, "rb") as f:
                    f.seek(offset)
                    blob = bytearray(f.read(self.manifest.blob_bytes))
                self.arena.slots[slot].copy_(torch.frombuffer(blob, dtype=torch.uint8))
                self.lru[key] = slot
                self.loads += 1
                source = Tier.STORE
            self.pins[key] = self.pins.get(key, 0) + 1
            yield [ReadyExpert(expert, self.lru[key], source)]

    def release(self, layer, experts):
        for expert in experts:
            key = ExpertKey(layer, expert)
            assert self.pins.get(key), f"release of unpinned {key}"
            self.pins[key] -= 1
