"""The device tier: which expert is in which arena slot, who pins it, what loads next.

``Residency`` (``core``) is the facade over parts that each own their state: the slot table
(``slots``), pins and clients (``sessions``, ``clients``, ``channel``), loads in flight
(``loads``, ``loader``), admission (``admission``), prefetch (``prefetcher``) and live settings
(``switches``). The design (glossary, admission, deadlock freedom, prefetch) is in
docs/residency.md.
"""

from cache_daemon.residency.admission import Ready
from cache_daemon.residency.clients import UNBOUND_CLAIM_EXPIRY_S, ClientLedger, Session
from cache_daemon.residency.core import Residency, ResidencyStats, SlotInfo, table_entries
from cache_daemon.residency.prefetcher import PREFETCH_KINDS

__all__ = [
    "PREFETCH_KINDS",
    "UNBOUND_CLAIM_EXPIRY_S",
    "ClientLedger",
    "Ready",
    "Residency",
    "ResidencyStats",
    "Session",
    "SlotInfo",
    "table_entries",
]
