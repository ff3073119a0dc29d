"""The device tier: which expert is in which arena slot, who pins it, what loads next.

Glossary (worked example: an arena of 4 slots; stream A sends ``Acquire(decoder_layer=1,
experts=[0, 5])`` while L1E0 is already in slot 2 and L1E5 is nowhere):

- *entry*: the slot-table row of one ``ExpertKey`` (index ``layer * num_experts + expert``):
  state, slot, pins, generation — kept only in the native table (``slots``).
- *state*: ``ABSENT`` (in no slot) → ``LOADING`` (slot reserved; an I/O thread is writing it) →
  ``RESIDENT`` (the slot holds the checksum-verified blob). A failed load goes back to ABSENT.
- *pin*: a claim on a key, counted in the table: each Demand session's (``Session.held`` records
  its own, to give them back) and compute's shared-memory ones. A key with pins is never evicted
  and its slot never overwritten; a slot is readable only RESIDENT and pinned.
- *generation*: the loads completed into a slot for the key, so two residencies of the same key
  can be told apart.
- *admission*: the one step in which an Acquire pins its resident keys and reserves slots for
  its missing ones — all of them, or nothing.

::

    acquire(A, layer 1, [0, 5])
      admit (under the lock, all or nothing):
        L1E0 RESIDENT slot 2 → hold for A                    → yield Ready(L1E0, 2, DEVICE) now
        L1E5 ABSENT          → free slot 0 (or evict the policy's victim among entries with no
                               pins) → LOADING, hold for A, submit the load to the I/O pool
      I/O thread (loader): host tier has L1E5? copy host slot → arena slot 0     (source HOST)
                  else read store → host slot (CRC-32) → copy to arena slot 0    (source STORE)
        → RESIDENT, notify                                   → yield Ready(L1E5, 0, source)
    release(A, [L1E0, L1E5]) → no pins left → both evictable

Why it never deadlocks: an Acquire takes nothing until everything it needs is available at
once (resident keys, keys already loading, and free-or-evictable slots for the rest), so two
Acquires never each hold part of what the other waits for. A wait ends when another stream
releases or closes, a load finishes or is cancelled, compute unpins the last shared-memory pin
of an entry (the table's futex word, watched by a thread of the residency), or after
``acquire_timeout_s`` (``AcquireTimeout``). An Acquire that could never be admitted while its
own stream keeps its pins is refused at once (``BadAcquire``): a layer with more experts than
slots is processed in waves. Two streams that demand the same missing key share one load.

The compute fast path: compute maps the same table and pins RESIDENT entries itself (no RPC),
sending a Demand only for the others. Its accesses reach the policy as the table's access
stamps, fed in stamp order before each decision (``clients.Recency``), so LRU stays LRU. A
compute process gets a client ledger at Attach and ties it to its Demand stream; when that
stream ends the ledger's pins are reclaimed, so a killed compute process never leaves slots
pinned. The protocol is in ``csrc/include/expertcache/slot_table.h``.

Prefetch (``prefetcher``): a worker thread, woken whenever the predictions change (compute's
``Route`` / ``LayerAhead`` messages, a predictor hint batch as it arrives), a load completes or
a pin is released, asks ``cache_daemon.decisions.PrefetchScheduler`` what to load ahead and
starts each as a LOADING entry without holders, read at its class's priority on a separate pool
of prefetch threads, so a demand load never queues behind one (and the store starts no prefetch
read while a demand read is queued or in flight). A layer's Route and LayerAhead usually arrive
inside its Acquire: they are applied in the same hold of the lock as its admission, just before
it, so its demand loads are queued before the prefetches they trigger::

    demand for a key a prefetch is loading → joins that load, promotes it to DEMAND priority
    demand short of slots                  → cancels queued prefetches (their slots come free
                                             when the reads' issued chunks land; never awaited)
    prefetched key used before eviction    → used (accuracy); evicted unused → wasted

Modules: ``slots`` (the table and the free-slot allocator), ``clients`` (sessions, ledgers,
recency), ``loader`` (I/O pools and the fill), ``prefetcher`` (the worker), ``core``
(``Residency``: the wiring, reads, introspection, shutdown), with its parts ``admission``
(acquire, admission, waits), ``loads`` (a load's start, promotion, cancellation, result),
``sessions`` (Demand sessions, client ledgers, release) and ``switches`` (live settings).
Incoming signals are checked and applied by ``cache_daemon.decisions.intake`` (``Residency.intake``). ``cache_daemon.daemon.CacheDaemon`` wires the manifest,
store, host tier, arena and ``Residency`` together; the gRPC servicer (``cache_daemon.server``)
converts and delegates.
"""

from cache_daemon.residency.admission import Ready
from cache_daemon.residency.clients import UNBOUND_CLAIM_EXPIRY_S, ClientLedger, Session
from cache_daemon.residency.core import Residency, ResidencyStats, SlotInfo, table_entries
from cache_daemon.residency.prefetcher import PREFETCH_KINDS
from cache_daemon.residency.slots import SlotState

__all__ = [
    "PREFETCH_KINDS",
    "UNBOUND_CLAIM_EXPIRY_S",
    "ClientLedger",
    "Ready",
    "Residency",
    "ResidencyStats",
    "Session",
    "SlotInfo",
    "SlotState",
    "table_entries",
]
