"""The predictor's side of the store: finished EAMs queued for insertion, the background thread
that inserts and syncs them, and whether the store answers.

``observe`` only queues here and wakes the thread, so a store outage never slows or fails Observe
(docs/predictor.md).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from predictor_svc.catalog import Model, ModelCatalog
from predictor_svc.config import PredictorConfig
from predictor_svc.errors import CorruptEntry, StoreUnavailable
from predictor_svc.metrics import PredictorMetrics

logger = logging.getLogger(__name__)


@dataclass
class _PendingInsert:
    model: Model
    request_id: str
    eam: np.ndarray  # uint32 [L, E]
    tokens: int


@dataclass(eq=False, repr=False)
class InsertQueue:
    """Finished EAMs on their way to the store, and the thread that takes them; thread-safe."""

    _config: PredictorConfig
    _catalog: ModelCatalog
    _metrics: PredictorMetrics
    _clock: Callable[[], float]
    _on_sync: Callable[[], object]
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)  # _inserts, _bytes, _degraded
    _inserts: deque[_PendingInsert] = field(default_factory=deque, init=False)
    _bytes: int = field(default=0, init=False)
    _degraded: bool = field(default=False, init=False)
    # one thread at a time talks to the store
    _store_lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _wake: threading.Event = field(default_factory=threading.Event, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    # Set once every model's EAMC was loaded from the store (or the store found down): the
    # predictor is ready (health SERVING) only then, not while it predicts from nothing.
    loaded: threading.Event = field(default_factory=threading.Event, init=False)
    # notified when loaded is set and at close
    _settled: threading.Condition = field(default_factory=threading.Condition, init=False)

    def mark_loaded(self) -> None:
        with self._settled:
            self.loaded.set()
            self._settled.notify_all()

    def wait_loaded(self) -> bool:
        """Until every model's EAMC is loaded (True) or the queue is closed first (False)."""
        with self._settled:
            self._settled.wait_for(lambda: self.loaded.is_set() or self._stop.is_set())
            return self.loaded.is_set()

    def reconfigure(self, config: PredictorConfig) -> None:
        """Adopt a live-reloaded config; the thread picks up ``sync_interval_s`` and the queue
        bounds at its next step, which this brings forward."""
        with self._lock:
            self._config = config
        self._wake.set()

    def wake(self) -> None:
        """Run the thread's next step now (a new model's EAMC to load)."""
        self._wake.set()

    def add(self, model: Model, request_id: str, eam: np.ndarray, tokens: int) -> None:
        """Queue a finished request's EAM (too few ``tokens``: dropped, counted) and wake the thread."""
        cfg = self._config
        if tokens < cfg.min_request_tokens:
            self._metrics.inserts_dropped.inc()
            logger.debug("request %r has %d tokens: not inserted", request_id, tokens)
            return
        with self._lock:
            self._inserts.append(_PendingInsert(model, request_id, eam, tokens))
            self._bytes += eam.nbytes
            while len(self._inserts) > 1 and (
                len(self._inserts) > cfg.max_pending_inserts or self._bytes > cfg.max_pending_insert_bytes
            ):
                dropped = self._inserts.popleft()
                self._bytes -= dropped.eam.nbytes
                self._metrics.inserts_dropped.inc()
                logger.warning(
                    "insert retry queue full (max_pending_inserts=%d, max_pending_insert_bytes=%d): "
                    "dropping the EAM of request %r",
                    cfg.max_pending_inserts,
                    cfg.max_pending_insert_bytes,
                    dropped.request_id,
                )
        self._wake.set()

    def pending(self) -> tuple[int, int]:
        """(EAMs queued, their bytes)."""
        with self._lock:
            return len(self._inserts), self._bytes

    @property
    def degraded(self) -> bool:
        """The store's last answer was a failure (predicting from memory until it is back)."""
        with self._lock:
            return self._degraded

    # -- the thread --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="predictor-sync", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_sync = self._clock()
        while not self._stop.is_set():
            self._wake.wait(max(0.0, next_sync - self._clock()))
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                ok = self.flush()
                if self._clock() >= next_sync or not ok:
                    self.sync_now()
                    next_sync = self._clock() + self._config.sync_interval_s
            except Exception:  # noqa: BLE001 - the background thread must survive anything
                logger.exception("predictor background step failed")
                next_sync = self._clock() + self._config.sync_interval_s
            if not self._inserts_ok():
                # Store down: wait a full interval before retrying, do not spin on the wake event.
                self._stop.wait(self._config.sync_interval_s)

    def _inserts_ok(self) -> bool:
        with self._lock:
            return not (self._inserts and self._degraded)

    def flush(self) -> bool:
        """Insert queued finished EAMs in order; False when the store failed (they stay queued)."""
        with self._store_lock:
            while True:
                with self._lock:
                    if not self._inserts:
                        return True
                    item = self._inserts[0]
                try:
                    entry_id = item.model.eamc.insert(item.eam, item.tokens)
                except Exception as exc:  # noqa: BLE001 - store down, corrupt, Conflict after retries: try later
                    self._store_failed("insert", exc)
                    return False
                with self._lock:
                    if self._inserts and self._inserts[0] is item:
                        self._inserts.popleft()
                        self._bytes -= item.eam.nbytes
                self._store_ok()
                self._metrics.entries_inserted.inc()
                logger.debug(
                    "request %r inserted as entry %s of %r", item.request_id, entry_id, item.model.model_id
                )

    def sync_now(self) -> None:
        """One background step: sync the model catalog and every model's EAMC with the store,
        then ``on_sync`` (the service expires quiet requests)."""
        with self._store_lock:
            self.sync_catalog()
        with self._store_lock:
            for model in self._catalog.models():
                try:
                    model.eamc.sync()
                except (StoreUnavailable, CorruptEntry) as exc:
                    self._store_failed("sync", exc)
                else:
                    self._store_ok()
        self.mark_loaded()
        self._on_sync()

    def sync_catalog(self) -> None:
        """The catalog's half of a sync; a store failure is counted, not raised."""
        try:
            self._catalog.sync()
        except (StoreUnavailable, CorruptEntry) as exc:  # degraded: the next sync retries
            self._store_failed("sync", exc)

    # -- store health ------------------------------------------------------------------------
    def _store_failed(self, op: str, exc: BaseException) -> None:
        self._metrics.store_errors.labels(op).inc()
        with self._lock:
            was, self._degraded = self._degraded, True
        if not was:
            logger.warning("EAMC store %s failed, predicting from memory until it is back: %s", op, exc)
        else:
            logger.debug("EAMC store %s still failing: %s", op, exc)

    def _store_ok(self) -> None:
        with self._lock:
            was, self._degraded = self._degraded, False
        if was:
            logger.warning("EAMC store is back")

    def close(self, timeout_s: float) -> None:
        """Stop the thread, then one last insert attempt: finished requests reach the store
        before it is closed or saved."""
        with self._settled:
            self._stop.set()
            self._settled.notify_all()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.flush()
