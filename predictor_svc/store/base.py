"""The EAMC store interface: where the EAM collection of each model lives (Redis or embedded).

Both implementations keep, per model, a map ``entry_id -> blob`` (blobs in the
``predictor_svc.eam`` entry format) and a bounded change log. A reader holds a *cursor* (an
opaque string) into the log and asks for the changes since it, so replicas stay in sync
without reloading the collection; a cursor older than the log's tail gets ``None`` and must
reload.

Ownership/atomicity contract:
- ``insert`` is atomic: below ``capacity`` it appends a new entry; at capacity it replaces
  exactly ``victim_id`` (the caller's choice: the most similar entry). If the collection is at
  capacity and ``victim_id`` is None or no longer present, or the collection is below capacity
  but the caller named a victim, the store raises ``Conflict`` and changes nothing; the caller
  re-syncs and retries. A blob is written whole or not at all (no torn entry).
- Every call that talks to a server raises ``StoreUnavailable`` naming the URL when it cannot.

The model catalog (``models`` / ``register_model``) is shared by every replica: a model's
routing shape, ``"LAYERSxEXPERTSxTOP_K"``, registered once. ``register_model`` is atomic: it
never overwrites a registered shape and never registers more than ``max_models`` models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable


@dataclass(frozen=True)
class Change:
    """One change-log record: ``op`` "put" (blob set) or "del" (blob None) of ``entry_id``."""

    op: Literal["put", "del"]
    entry_id: str
    blob: bytes | None


@runtime_checkable
class EamcStore(Protocol):
    """Per-model EAM collections with a change log. See the module docstring for semantics. The
    stores subclass it, so that they inherit its optional methods' defaults (``time_round_trips``)."""

    def load(self, model_id: str) -> tuple[dict[str, bytes], str]:
        """All entries of ``model_id`` and the cursor at which that snapshot was taken."""
        ...

    def entry_ids(self, model_id: str) -> tuple[list[str], str]:
        """The ids of ``model_id``'s entries and the cursor at which they were listed (no blobs:
        a reader fetches them in bounded batches with ``get_many``; an entry id's blob never
        changes within one collection incarnation, and changes after the cursor replay)."""
        ...

    def get_many(self, model_id: str, entry_ids: list[str]) -> dict[str, bytes]:
        """The blobs of those of ``entry_ids`` still present."""
        ...

    def refill(self, model_id: str, cursor: str, blobs: list[bytes], capacity: int) -> str | None:
        """Append ``blobs`` (up to ``capacity`` entries) if the collection is still as at
        ``cursor`` (nobody else wrote since): the new cursor, else None and nothing changed. How
        a replica puts back a collection the store lost (Redis restarted empty) without two
        replicas both putting theirs."""
        ...

    def changes(self, model_id: str, cursor: str, limit: int = 0) -> tuple[list[Change], str] | None:
        """Changes after ``cursor`` in order (at most ``limit`` when > 0: the cursor returned is
        then at the last one) and the new cursor; None if ``cursor`` is too old."""
        ...

    def insert(self, model_id: str, blob: bytes, capacity: int, victim_id: str | None) -> str:
        """Atomically append (below capacity) or replace ``victim_id`` (at capacity).

        Returns the new entry's id (the removal of the victim shows in ``changes``). Raises
        Conflict when the collection no longer matches the caller's view.
        """
        ...

    def models(self) -> dict[str, str]:
        """The model catalog: model id -> ``"LAYERSxEXPERTSxTOP_K"``."""
        ...

    def register_model(self, model_id: str, shape: str, max_models: int) -> tuple[str, str]:
        """Atomically register ``model_id`` with ``shape`` (``"LxExK"``) unless it is registered.

        Returns ``("created", shape)``, ``("exists", registered shape)`` (nothing changed, the
        caller compares) or ``("full", number registered)`` when ``max_models`` are registered.
        """
        ...

    def count(self, model_id: str) -> int:
        """Number of entries of ``model_id``."""
        ...

    def close(self) -> None:
        """Release connections / flush nothing; idempotent."""
        ...

    def time_round_trips(self, observe: Callable[[str, float], None]) -> None:
        """Have ``observe(operation, seconds)`` called after every round trip to a server (failed
        ones too), for the metrics. By default nothing: a store in process has no round trip."""
        return None
