"""The model catalog: which models this predictor serves, each with its shape and EAMC.

A model enters it configured (``model_shapes``), registered (RegisterModel: in the store's catalog
first, atomically) or registered on another replica (``sync``), always within the config's
bounds and never from an activation; the background thread (``inserts``) loads its EAMC. Why:
docs/predictor.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from predictor_svc.config import MODEL_ID_RE, PredictorConfig
from predictor_svc.eam import HEADER_BYTES, EamShape
from predictor_svc.eamc import Eamc
from predictor_svc.errors import BadActivation, LimitReached, ModelConflict, RegistrationDisabled
from predictor_svc.metrics import PredictorMetrics
from predictor_svc.store.base import EamcStore

logger = logging.getLogger(__name__)
# What a model already held here is written with when the store's catalog lacks it: it was
# admitted once, so the store's max_models bound does not refuse it again.
NO_MODEL_BOUND = 1 << 30


@dataclass(frozen=True)
class ModelStats:
    """One model's line of ``ServiceStats`` (the wire ``ModelStats``)."""

    model_id: str
    eamc_entries: int
    layers: int
    num_experts: int
    top_k: int
    live_requests: int


class Model:
    """One model's geometry and EAMC (``Eamc`` is thread-safe: the background thread syncs and
    inserts while Observe threads predict)."""

    def __init__(self, model_id: str, shape: EamShape, eamc: Eamc) -> None:
        self.model_id = model_id
        self.shape = shape
        self.eamc = eamc


class ModelCatalog:
    """The models served here, by id; thread-safe (one registration at a time)."""

    def __init__(self, config: PredictorConfig, store: EamcStore, metrics: PredictorMetrics) -> None:
        self._config = config
        self._store = store
        self._metrics = metrics
        self._lock = threading.Lock()  # _models
        self._register_lock = threading.Lock()  # one registration at a time (store round trip)
        self._models: dict[str, Model] = {}
        self._configured = config.shapes()
        self._persisted: set[str] = set()  # configured models written to the store's catalog
        self._skipped: set[str] = set()  # store catalog entries not loaded (logged once)
        self._created_by: dict[str, int] = {}  # client -> models it registered here
        for model_id, shape in self._configured.items():
            self._add(model_id, shape)

    def get(self, model_id: str) -> Model | None:
        with self._lock:
            return self._models.get(model_id)

    def models(self) -> list[Model]:
        with self._lock:
            return list(self._models.values())

    def reconfigure(self, config: PredictorConfig) -> None:
        """Adopt a live-reloaded config: ``eamc_capacity`` reaches every model's EAMC now."""
        with self._lock:
            self._config = config
            for model in self._models.values():
                model.eamc.capacity = config.eamc_capacity

    def stats(self, live_by_model: Mapping[str, int]) -> tuple[tuple[ModelStats, ...], int, int]:
        """Each model's stats (by id, with its count of ``live_by_model``), then the bytes the
        EAMCs hold and the bytes they reserve (``eamc_capacity`` full entries each)."""
        cfg = self._config
        infos = []
        eamc_bytes = reserved = 0
        for model in self.models():
            entries = model.eamc.entries
            eamc_bytes += entries * (HEADER_BYTES + 4 * model.shape.cells)
            reserved += cfg.eamc_reservation(model.shape.layers, model.shape.experts)
            infos.append(
                ModelStats(
                    model.model_id,
                    entries,
                    model.shape.layers,
                    model.shape.experts,
                    model.shape.top_k,
                    live_by_model.get(model.model_id, 0),
                )
            )
        return tuple(sorted(infos, key=lambda i: i.model_id)), eamc_bytes, reserved

    def _add(self, model_id: str, shape: EamShape) -> Model:
        """The model's state, created on first use (its EAMC empty until the next sync loads it)."""
        with self._lock:
            model = self._models.get(model_id)
            if model is not None:
                return model
            eamc = Eamc(self._store, model_id, shape, self._config.eamc_capacity)
            model = self._models[model_id] = Model(model_id, shape, eamc)
        logger.info(
            "model %r: %d layers x %d experts, top_k %d", model_id, shape.layers, shape.experts, shape.top_k
        )
        return model

    def _refuse(self, reason: str) -> None:
        self._metrics.refused.labels(reason).inc()

    # -- RegisterModel ---------------------------------------------------------------------
    def register(
        self, model_id: str, layers: int, experts: int, top_k: int, client: str = ""
    ) -> tuple[EamShape, bool]:
        """Register ``model_id``'s shape (RegisterModel): (shape, created). Idempotent for the same
        shape. Raises, changing nothing: InvalidArgument (BadActivation) for a bad field or
        beyond max_layers / max_experts, ModelConflict for another shape, RegistrationDisabled,
        LimitReached for max_models / max_eamc_bytes / max_client_models (models ``client`` created
        on this replica since it started), StoreUnavailable when the store's catalog cannot be
        written (the client retries)."""
        cfg = self._config
        if not model_id:
            raise BadActivation("RegisterModelRequest.model_id is empty")
        if not MODEL_ID_RE.match(model_id):
            raise BadActivation(
                f"RegisterModelRequest.model_id {model_id[:160]!r} is not 1-128 characters of "
                "[A-Za-z0-9._:/@+-] starting with a letter or digit"
            )
        for name, value in (("num_moe_layers", layers), ("num_experts", experts), ("top_k", top_k)):
            if value < 1:
                raise BadActivation(
                    f"RegisterModelRequest.{name} is {value} (model {model_id!r}); must be >= 1"
                )
        for name, value, limit_name, limit in (
            ("num_moe_layers", layers, "max_layers", cfg.max_layers),
            ("num_experts", experts, "max_experts", cfg.max_experts),
        ):
            if value > limit:
                self._refuse(limit_name)
                raise BadActivation(
                    f"RegisterModelRequest.{name} = {value} (model {model_id!r}) exceeds the limit "
                    f"{limit_name}={limit}"
                )
        if top_k > experts:
            raise BadActivation(
                f"RegisterModelRequest.top_k = {top_k} exceeds num_experts = {experts} (model {model_id!r})"
            )
        shape = EamShape(layers, experts, top_k)
        with self._register_lock:
            known = self.get(model_id)
            if known is not None:
                return self._same_shape(model_id, known.shape, shape), False
            if not cfg.allow_registration:
                self._refuse("registration_disabled")
                raise RegistrationDisabled(
                    f"model {model_id!r} is not configured (model_shapes) and registration is disabled "
                    "(allow_registration=false)"
                )
            self._check_room(model_id, shape)
            created_by = self._created_by.get(client, 0)
            if created_by >= cfg.max_client_models:
                self._refuse("client_models")
                raise LimitReached(
                    f"client {client!r} has registered {created_by} models, the limit max_client_models="
                    f"{cfg.max_client_models}: model {model_id!r} not registered"
                )
            status, value = self._store.register_model(model_id, shape.text, cfg.max_models)
            if status == "full":
                self._refuse("max_models")
                raise LimitReached(
                    f"the model catalog already holds {value} models, the limit max_models={cfg.max_models}: "
                    f"model {model_id!r} not registered"
                )
            if status == "exists":  # another replica registered it meanwhile
                try:
                    registered = EamShape.parse(value)
                except ValueError:
                    raise ModelConflict(
                        f"model {model_id!r} is registered with an unreadable shape {value!r}"
                    ) from None
                self._same_shape(model_id, registered, shape)
            else:
                self._created_by[client] = created_by + 1
            self._add(model_id, shape)
        logger.info("registered model %r: %s", model_id, shape.text)
        return shape, status == "created"

    def _same_shape(self, model_id: str, registered: EamShape, asked: EamShape) -> EamShape:
        if registered != asked:
            self._refuse("bad_shape")
            raise ModelConflict(
                f"model {model_id!r} is registered as {registered.text} (layers x experts x top_k), "
                f"not {asked.text}"
            )
        return registered

    def _check_room(self, model_id: str, shape: EamShape) -> None:
        """LimitReached when adding ``shape`` would pass max_models or max_eamc_bytes."""
        cfg = self._config
        with self._lock:
            count = len(self._models)
            reserved = sum(
                cfg.eamc_reservation(m.shape.layers, m.shape.experts) for m in self._models.values()
            )
        if count >= cfg.max_models:
            self._refuse("max_models")
            raise LimitReached(
                f"{count} models are registered, the limit max_models={cfg.max_models}: model {model_id!r} "
                "not registered"
            )
        need = cfg.eamc_reservation(shape.layers, shape.experts)
        if reserved + need > cfg.max_eamc_bytes:
            self._refuse("max_eamc_bytes")
            raise LimitReached(
                f"model {model_id!r} ({shape.text}) reserves {need} EAMC bytes (eamc_capacity="
                f"{cfg.eamc_capacity} entries), {reserved} are reserved already: beyond the limit "
                f"max_eamc_bytes={cfg.max_eamc_bytes}"
            )

    # -- the store's catalog ---------------------------------------------------------------
    def sync(self) -> None:
        """Write the models held here that the store's catalog lacks (the configured ones at
        first, any of them again after a Redis restarted empty) and take the models other
        replicas registered (unless registration is disabled here). StoreUnavailable propagates
        (the caller counts it)."""
        stored = self._store.models()
        with self._lock:
            held = {model_id: model.shape for model_id, model in self._models.items()}
        for model_id, shape in held.items():
            if model_id in stored:
                if model_id in self._configured and _parse_or_none(stored[model_id]) != shape:
                    if model_id not in self._persisted:
                        logger.error(
                            "configured model %r is %s but the store's catalog has %s: using the "
                            "configured shape",
                            model_id,
                            shape.text,
                            stored[model_id],
                        )
                self._persisted.add(model_id)
                continue
            if model_id in self._persisted:
                logger.warning("model %r is missing from the store's catalog: registering it again", model_id)
            self._store.register_model(model_id, shape.text, NO_MODEL_BOUND)
            self._persisted.add(model_id)
        if not self._config.allow_registration:
            return
        for model_id, text in stored.items():
            if self.get(model_id) is not None or model_id in self._skipped:
                continue
            try:
                shape = _parse_or_none(text)
                if shape is None or not MODEL_ID_RE.match(model_id):
                    raise BadActivation(f"unreadable catalog entry {text!r}")
                if shape.layers > self._config.max_layers or shape.experts > self._config.max_experts:
                    raise BadActivation(
                        f"{text} is beyond max_layers={self._config.max_layers} / "
                        f"max_experts={self._config.max_experts}"
                    )
                with self._register_lock:
                    self._check_room(model_id, shape)
                    self._add(model_id, shape)
            except (BadActivation, LimitReached) as exc:
                self._skipped.add(model_id)
                logger.warning("not loading registered model %r: %s", model_id, exc)


def _parse_or_none(text: str) -> EamShape | None:
    """The shape a store's catalog entry names; None when unreadable (written by something else)."""
    try:
        return EamShape.parse(text)
    except ValueError:
        return None
