"""The bandwidth-bound ceiling of a batched run: what the link allows, whatever the compute.

A decode step of B requests loads, per MoE layer, the union of the experts the B requests route
to (compute acquires that union in one Demand). The fewest bytes any cache of ``capacity`` slots
can load for a sequence of such unions is Belady's: on a miss, evict the resident expert whose next
use is farthest away, never one of the union being served. The ceiling of throughput is then

    tokens generated / (Belady's bytes / link bandwidth)

which no policy and no prefetcher can beat on that link (prefetch only moves bytes earlier; it
cannot remove them). Compute time is left out on purpose: the figure says what bandwidth allows.

The run modelled is the serving benchmark's (``bench.serve``): requests in waves of ``batch``
consecutive trace requests that start together and generate ``tokens`` each (continuous batching
keeps them in lockstep when they are equally long). Forward 0 (the prefill) routes every prompt
token by the request's first decode row and forward i by row i, wrapping past the request's last
row, as compute's forced routing does (``replay.forced_routing``). The cache starts cold,
like a freshly started daemon.

No I/O, no threads: pure arithmetic over the trace, beside the replay's ``simulator``.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from expertcache.trace import RoutingTrace

__all__ = ["BatchCeiling", "batch_ceiling", "batched_unions", "belady_loads", "requests_with_decode_rows"]


@dataclass(frozen=True)
class BatchCeiling:
    """What the link allows for one batched run."""

    batch: int
    requests: int
    tokens: int  # generated tokens of all requests
    steps: int  # forwards of all waves
    mean_union: float  # experts per MoE layer per step, averaged
    loads: int  # Belady's demand loads (cold start)
    bytes: int  # loads x expert bytes
    link_bytes_per_s: float

    @property
    def transfer_s(self) -> float:
        return self.bytes / self.link_bytes_per_s

    @property
    def tokens_per_s(self) -> float:
        """The ceiling: tokens over the time the link needs for Belady's bytes (inf when the
        run loads nothing)."""
        return self.tokens / self.transfer_s if self.bytes else float("inf")

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / max(1, self.tokens)


def batched_unions(
    trace: RoutingTrace, requests: Sequence[int], batch: int, tokens: int
) -> list[list[np.ndarray]]:
    """Per wave of ``batch`` requests, per forward, per MoE layer: the union of routed experts.

    Returns a flat list of steps; each step is a list (one per layer) of sorted expert ids."""
    if batch < 1 or tokens < 1:
        raise ValueError(f"batch ({batch}) and tokens ({tokens}) must be >= 1")
    steps: list[list[np.ndarray]] = []
    for first in range(0, len(requests), batch):
        wave = requests[first : first + batch]
        spans = []
        for r in wave:
            start, end = trace.decode_rows(r)
            if end <= start:
                raise ValueError(f"trace request {r} has no decode rows")
            spans.append((start, end - start))
        for step in range(tokens):
            rows = np.fromiter((start + step % span for start, span in spans), np.int64, len(spans))
            routed = trace.expert_ids[rows]  # [B, L, K]
            steps.append([np.unique(routed[:, layer, :]) for layer in range(trace.num_layers)])
    return steps


def belady_loads(steps: list[list[np.ndarray]], num_experts: int, capacity: int) -> int:
    """Demand loads of Belady's eviction over the per-layer unions of ``steps``, cold start."""
    accesses: list[np.ndarray] = []  # one set of entries (layer * num_experts + expert) per layer-step
    for layers in steps:
        for layer, experts in enumerate(layers):
            accesses.append(experts.astype(np.int64) + layer * num_experts)
    widest = max((len(a) for a in accesses), default=0)
    if capacity < widest:
        raise ValueError(f"capacity {capacity} slots is below one layer's union of {widest} experts")
    never = len(accesses)
    # next_use[i][j]: the next access index after i that needs accesses[i][j]
    next_use: list[np.ndarray] = [np.empty(0, np.int64)] * len(accesses)
    upcoming: dict[int, int] = {}
    for i in range(len(accesses) - 1, -1, -1):
        entries = accesses[i]
        next_use[i] = np.fromiter((upcoming.get(int(e), never) for e in entries), np.int64, len(entries))
        for e in entries:
            upcoming[int(e)] = i
    resident: dict[int, int] = {}  # entry -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, entry), lazily invalidated
    loads = 0
    for i, entries in enumerate(accesses):
        needed = set(int(e) for e in entries)
        misses = [e for e in needed if e not in resident]
        loads += len(misses)
        # Room for the misses: evict the farthest next use among residents not needed now (every
        # resident not in ``needed`` has its next use after i, so none of those is in this set).
        while len(resident) + len(misses) > capacity:
            neg, victim = heapq.heappop(heap)
            if resident.get(victim) == -neg and victim not in needed:
                del resident[victim]
        for e, nxt in zip(entries.tolist(), next_use[i].tolist(), strict=True):
            resident[e] = nxt
            heapq.heappush(heap, (-nxt, e))
    return loads


def batch_ceiling(
    trace: RoutingTrace,
    *,
    batch: int,
    tokens: int,
    capacity: int,
    expert_bytes: int,
    link_bytes_per_s: float,
    requests: Sequence[int] | None = None,
    first_request: int = 0,
    num_requests: int | None = None,
) -> BatchCeiling:
    """The ceiling of a run of ``num_requests`` (default ``batch``) trace requests with decode rows,
    from ``first_request`` on (wrapping, as forced routing hands them out), or of ``requests``."""
    if link_bytes_per_s <= 0 or expert_bytes <= 0:
        raise ValueError("link bandwidth and expert bytes must be positive")
    if requests is None:
        requests = requests_with_decode_rows(trace, first_request, num_requests or batch)
    steps = batched_unions(trace, list(requests), batch, tokens)
    loads = belady_loads(steps, trace.num_experts, capacity)
    sizes = [len(u) for layers in steps for u in layers]
    return BatchCeiling(
        batch=batch,
        requests=len(requests),
        tokens=len(requests) * tokens,
        steps=len(steps),
        mean_union=float(np.mean(sizes)) if sizes else 0.0,
        loads=loads,
        bytes=loads * expert_bytes,
        link_bytes_per_s=float(link_bytes_per_s),
    )


def requests_with_decode_rows(trace: RoutingTrace, first: int, count: int) -> list[int]:
    """``count`` trace requests with decode rows from ``first`` on, wrapping (compute's order)."""
    out: list[int] = []
    r = first % trace.num_requests
    skipped = 0
    while len(out) < count:
        start, end = trace.decode_rows(r)
        if end > start:
            out.append(r)
            skipped = 0
        else:
            skipped += 1
            if skipped > trace.num_requests:
                raise ValueError(f"trace {trace.path} has no request with decode rows")
        r = (r + 1) % trace.num_requests
    return out
