"""The state the residency's parts share, named once with its owner.

``Residency`` (``core``) is assembled from parts, each in its own module: ``admission``
(acquire, admit, waits), ``loads`` (a load's start, promotion, cancellation and result),
``sessions`` (Demand sessions, client ledgers, release) and ``switches`` (live settings). They
all work on the state below, under the one condition variable ``_cond``, set up by
``Residency.__init__``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cache_daemon.decisions.intake import SignalIntake
    from cache_daemon.decisions.policy import EvictionPolicy
    from cache_daemon.decisions.scheduler import PrefetchQueue, PrefetchScheduler
    from cache_daemon.decisions.signals import ActivationSignals
    from cache_daemon.metrics import DaemonMetrics
    from cache_daemon.residency.channel import ChannelServer
    from cache_daemon.residency.clients import ClientLedgers, Recency, Session
    from cache_daemon.residency.loader import Loader
    from cache_daemon.residency.prefetcher import Prefetcher
    from cache_daemon.residency.slots import Slots
    from cache_daemon.tiers.device import DeviceArena
    from expertcache.keys import ExpertKey
    from expertcache.layers import LayerMap
    from expertcache.manifest import StoreManifest
    from expertcache.native import SlotTable


class ResidencyState:
    """What each part of ``Residency`` may read and change (under ``_cond``), and the one way to
    the eviction policy."""

    _manifest: StoreManifest
    _layers: LayerMap
    _num_experts: int
    _blob_bytes: int
    _arena: DeviceArena
    _metrics: DaemonMetrics
    _timeout_s: float  # acquire_timeout_s
    _lock: threading.RLock
    _cond: threading.Condition  # admissions and acquires waiting for slots or loads
    _watch: threading.Condition  # the unpin watcher
    _table: SlotTable  # entry state, slot, generation, the daemon's holds, the clients' regions
    slots: Slots  # the table's view, and the free-slot allocator
    queue: PrefetchQueue  # loads in flight, demand and prefetch
    _ledgers: ClientLedgers
    _recency: Recency
    _sessions: set[Session]
    _channels: dict[Session, ChannelServer]  # the channel servers of the bound client ledgers
    _client_waits: dict[ExpertKey, list[tuple[ChannelServer, int]]]  # which of them wait for which load
    _closing: bool
    demand_waiting: int  # admissions waiting for slots: prefetch stands aside
    _unpin_seen: int | None  # the unpin word as the oldest waiting admission read it
    _strays: dict[int, tuple[frozenset[int], float]]  # suspect client ledgers: stray pins, first seen
    signals: ActivationSignals
    intake: SignalIntake
    _loader: Loader
    _prefetcher: Prefetcher

    @property
    def scheduler(self) -> PrefetchScheduler:
        """The prefetch scheduler; it holds the eviction policy that the residency evicts by too."""
        return self._prefetcher.scheduler

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy (held by the scheduler: one policy for eviction and prefetch)."""
        return self._prefetcher.scheduler.policy
