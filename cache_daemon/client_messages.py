"""One client's messages, whichever transport brought them (the Demand stream or the ledger's
shared-memory channel): each kind is checked, counted and traced here, once.

A transport decodes its wire format and calls ``ClientMessages``; what it gets back are intake ops
(``SignalIntake.apply_ops``). A prediction is advice: a malformed one is dropped and counted
(``signals_rejected``), the first of each kind logged per client, and the client goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from cache_daemon.decisions.intake import LookaheadSignal, RouteSignal
from cache_daemon.decisions.signals import LayerPrediction
from cache_daemon.tiers.base import Tier
from expertcache import telemetry
from expertcache.errors import InvalidArgument

if TYPE_CHECKING:
    from prometheus_client import Counter

    from cache_daemon.decisions.intake import SignalIntake
    from expertcache.keys import ExpertKey

logger = logging.getLogger(__name__)

# An Acquire carries at most this many routes, and as many lookaheads (one per request of
# compute's largest batch).
MAX_CARRIED_SIGNALS = 4096

Signal = RouteSignal | LookaheadSignal
Op = tuple[str, object]  # ("begin" | "end", request_id) or ("signal", Signal)


class ClientMessages:
    """Checks one client's one-way messages into intake ops."""

    def __init__(self, intake: SignalIntake, rejected: Counter, who: str) -> None:
        self._intake = intake
        self._rejected = rejected
        self._who = who
        self._warned: set[str] = set()

    def begin(self, request_id: str) -> Op:
        return ("begin", request_id)

    def end(self, request_id: str) -> Op:
        return ("end", request_id)

    def route(self, request_id: str, token: int, layer: int, experts: Iterable[int]) -> Op | None:
        try:
            return ("signal", self._intake.check_route(request_id, token, layer, experts))
        except InvalidArgument as exc:
            self.reject("route", str(exc))
            return None

    def layer_ahead(
        self, request_id: str | None, token: int, predictions: Sequence[LayerPrediction]
    ) -> Op | None:
        try:
            return ("signal", self._intake.check_layer_ahead(token, predictions, request_id or None))
        except InvalidArgument as exc:
            self.reject("layer_ahead", str(exc))
            return None

    def check_carried(self, layer: int, routes: int, aheads: int) -> None:
        """``InvalidArgument`` if an acquire of ``layer`` carries more than
        ``MAX_CARRIED_SIGNALS`` routes or lookaheads."""
        for name, count in (("routes", routes), ("layer_aheads", aheads)):
            if count > MAX_CARRIED_SIGNALS:
                raise InvalidArgument(
                    f"Acquire for layer {layer} carries {count} {name}; at most "
                    f"{MAX_CARRIED_SIGNALS} (one per request of compute's largest batch)"
                )

    def reject(self, kind: str, why: str) -> None:
        self._rejected.inc()
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(
                "dropping malformed %s messages from %s (counted in signals_rejected): %s",
                kind,
                self._who,
                why,
            )


class AcquireTrace:
    """The daemon's spans of one traced acquire, under the client's: ``acquire`` over it all, a
    ``fetch`` per expert that was not resident (its tier, bytes, whether and by which signal it
    was prefetched) and a ``wait`` until the last of them was ready."""

    def __init__(
        self, parent: Mapping[str, str], layer: int, experts: Sequence[int], blob_bytes: int
    ) -> None:
        self._tracer = telemetry.tracer()
        self._started_ns = time.time_ns()
        self._span = self._tracer.start_span(
            "acquire",
            context=telemetry.extract(dict(parent)),
            kind=telemetry.SpanKind.SERVER,
            start_time=self._started_ns,
            attributes={"expertcache.layer": layer, "expertcache.experts": [int(e) for e in experts]},
        )
        self._context = telemetry.context_of(self._span)
        self._blob_bytes = blob_bytes
        self._demanded = len(experts)
        self._hits = self._prefetch_hits = self._moved = 0
        self._last_ns: int | None = None
        self._ended = False

    @classmethod
    def start(
        cls, parent: Mapping[str, str] | None, layer: int, experts: Sequence[int], blob_bytes: int
    ) -> AcquireTrace | None:
        """A trace for this acquire when tracing is on and the client sent its context."""
        if not (telemetry.ENABLED and parent):
            return None
        return cls(parent, layer, experts, blob_bytes)

    def ready(self, key: ExpertKey, source: Tier, prefetch: str = "") -> None:
        """``key`` is ready, found in ``source`` (brought by the prefetch ``prefetch``, if any)."""
        self._prefetch_hits += bool(prefetch)
        if source is Tier.DEVICE:
            self._hits += 1
            return
        self._last_ns = time.time_ns()
        self._moved += self._blob_bytes
        self._tracer.start_span(
            "fetch",
            context=self._context,
            start_time=self._started_ns,
            attributes={
                "expertcache.layer": key.layer,
                "expertcache.expert": key.expert,
                "expertcache.tier": source.value,
                "expertcache.bytes": self._blob_bytes,
                "expertcache.prefetch_hit": bool(prefetch),
                "expertcache.prefetch_kind": prefetch,
            },
        ).end(end_time=self._last_ns)

    def end(self) -> None:
        """The acquire is over (every expert ready, or it failed). Idempotent."""
        if self._ended:
            return
        self._ended = True
        if self._last_ns is not None:
            self._tracer.start_span(
                "wait",
                context=self._context,
                start_time=self._started_ns,
                attributes={"expertcache.wait_s": (self._last_ns - self._started_ns) / 1e9},
            ).end(end_time=self._last_ns)
        self._span.set_attributes(
            {
                "expertcache.device_hits": self._hits,
                "expertcache.misses": self._demanded - self._hits,
                "expertcache.prefetch_hits": self._prefetch_hits,
                "expertcache.bytes_moved": self._moved,
                "expertcache.wait_s": (time.time_ns() - self._started_ns) / 1e9,
            }
        )
        self._span.end()


__all__ = ["MAX_CARRIED_SIGNALS", "AcquireTrace", "ClientMessages", "Op", "Signal"]
