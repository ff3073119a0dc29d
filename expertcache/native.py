"""Thin wrapper over the ``expertcache_native`` extension built from ``csrc/`` by ``make native``.

The extension is loaded from ``build/native/`` of this checkout. Exceptions come from C++:
``IndexError`` (entry/slot index out of range), ``ValueError`` (bad argument, bad slot-table
file, double free), ``RuntimeError`` (illegal state transition, pool exhausted, system error);
messages name the slot-table path where there is one.

``SlotTable`` (shared memory, one entry per ``(layer, expert)`` index):
``create(path, num_entries, num_slots)`` / ``open(path)``; ``try_pin(e) -> int | None``,
``unpin(e)``, ``begin_load(e, slot)``, ``finish_load(e)``, ``abort_load(e)``,
``try_evict(e) -> bool``, ``wait_resident(e, timeout_s) -> bool`` (releases the GIL),
``state(e)`` (a ``SlotState`` value), ``pins(e)``, ``slot(e)``, ``generation(e)``.

``HostPool(num_slots, slot_bytes)``: 4 KiB-aligned slots; ``alloc() -> int``, ``free(i)``,
``view(i) -> memoryview``, ``base_address``, ``slot_address(i)``, ``stride``, ``num_free``.
"""

from __future__ import annotations

import importlib.util
from enum import IntEnum
from pathlib import Path

BUILD_DIR = Path(__file__).resolve().parents[1] / "build" / "native"


def _load():
    candidates = sorted(BUILD_DIR.glob("expertcache_native*.so"))
    if not candidates:
        raise ImportError(
            f"expertcache_native is not built (no expertcache_native*.so in {BUILD_DIR}); run `make native`"
        )
    spec = importlib.util.spec_from_file_location("expertcache_native", candidates[-1])
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise ImportError(f"cannot load {candidates[-1]} ({e}); rebuild it with `make native`") from e
    return module


_native = _load()

SlotTable = _native.SlotTable
HostPool = _native.HostPool


class SlotState(IntEnum):
    ABSENT = _native.ABSENT
    LOADING = _native.LOADING
    RESIDENT = _native.RESIDENT
    EVICTING = _native.EVICTING


__all__ = ["BUILD_DIR", "HostPool", "SlotState", "SlotTable"]
