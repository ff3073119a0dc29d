"""Compute-service metrics: in-process counters, rendered in the Prometheus text format.

Names carry their unit and no colons (STYLE.md):

- ``moe_compute_tokens_total``                 generated tokens
- ``moe_compute_token_latency_seconds``        per-token latency (``_sum`` / ``_count``)
- ``moe_compute_expert_acquires_total{tier}``  experts used, by the tier they were found in
- ``moe_compute_stall_seconds_total``          time spent waiting for experts
- ``moe_compute_requests_total{finish_reason}`` finished requests (``error``, ``cancelled`` too)
- ``moe_compute_queue_depth``                  requests waiting for a place in the batch
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from compute_svc.moe import CacheCounters


class ComputeMetrics:
    """Thread-safe counters shared by the worker (tokens) and gRPC threads (queue, requests)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.tokens_total = 0
        self.token_latency_seconds_sum = 0.0
        self.stall_seconds_total = 0.0
        self.expert_acquires_total: Counter[str] = Counter()
        self.requests_total: Counter[str] = Counter()
        self.queue_depth = 0

    def record_token(self, latency_s: float) -> None:
        with self._lock:
            self.tokens_total += 1
            self.token_latency_seconds_sum += latency_s

    def record_step(self, counters: CacheCounters) -> None:
        """One forward's expert cache activity (shared by the requests of the step)."""
        with self._lock:
            self.stall_seconds_total += counters.stall_s
            for tier, count in counters.by_tier.items():
                self.expert_acquires_total[tier.value] += count

    def record_finish(self, reason: str) -> None:
        with self._lock:
            self.requests_total[reason] += 1

    def set_queue_depth(self, depth: int) -> None:
        with self._lock:
            self.queue_depth = depth

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        with self._lock:
            lines = [
                "# TYPE moe_compute_tokens_total counter",
                f"moe_compute_tokens_total {self.tokens_total}",
                "# TYPE moe_compute_token_latency_seconds summary",
                f"moe_compute_token_latency_seconds_sum {self.token_latency_seconds_sum}",
                f"moe_compute_token_latency_seconds_count {self.tokens_total}",
                "# TYPE moe_compute_stall_seconds_total counter",
                f"moe_compute_stall_seconds_total {self.stall_seconds_total}",
                "# TYPE moe_compute_expert_acquires_total counter",
                *(
                    f'moe_compute_expert_acquires_total{{tier="{tier}"}} {n}'
                    for tier, n in sorted(self.expert_acquires_total.items())
                ),
                "# TYPE moe_compute_requests_total counter",
                *(
                    f'moe_compute_requests_total{{finish_reason="{reason}"}} {n}'
                    for reason, n in sorted(self.requests_total.items())
                ),
                "# TYPE moe_compute_queue_depth gauge",
                f"moe_compute_queue_depth {self.queue_depth}",
            ]
        return "\n".join(lines) + "\n"
