"""Records every request's routing to an ``.npz`` routing trace (format: ``expertcache.trace``).

Written by a thread of its own, kept in memory until close: a tool for building traces, not an
always-on log. Rows and layers: docs/compute.md."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compute_svc.engine.activations import StepRouting
from expertcache.trace import TraceRequest, expert_dtype, write_trace

logger = logging.getLogger(__name__)


@dataclass
class _Recording:
    prompt_tokens: int = 0
    experts: list[np.ndarray] = field(default_factory=list)  # each [T, L, K] int64
    weights: list[np.ndarray] = field(default_factory=list)  # each [T, L, K] float16


class TraceRecorder:
    """Collects requests' routing and writes them as one trace file, atomically.

    ``meta`` must hold ``num_layers`` (MoE layers), ``num_experts`` and ``top_k``; it is written
    to ``meta_json`` together with ``expert_ids_dtype``. ``on_step`` / ``on_request_end`` are
    called from the generation thread and only append; files are written by a writer thread.
    """

    def __init__(self, path: str | Path, meta: dict[str, Any], *, every_requests: int = 16) -> None:
        for key in ("num_layers", "num_experts", "top_k"):
            if key not in meta:
                raise ValueError(f"trace meta lacks {key!r}")
        if every_requests < 1:
            raise ValueError(f"every_requests must be >= 1, got {every_requests}")
        self.path = Path(path)
        self.every_requests = every_requests
        self.expert_dtype = expert_dtype(int(meta["num_experts"]))
        self.meta = dict(meta)
        self._lock = threading.Lock()
        self._live: dict[str, _Recording] = {}
        self._done: list[tuple[dict[str, Any], np.ndarray, np.ndarray]] = []  # (req meta, experts, weights)
        self._written = 0  # requests in the file on disk
        self._wake = threading.Condition(self._lock)
        self._closing = False
        self.files_written = 0
        self._write_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="trace-writer", daemon=True)
        self._thread.start()

    # -- generation thread ----------------------------------------------------------------------
    def on_step(self, step: StepRouting, prompt_tokens: int) -> None:
        """Append one forward's routing (``step.weights`` must be set)."""
        if step.weights is None:
            raise ValueError("TraceRecorder needs the router weights: take() the step with_weights=True")
        with self._lock:
            rec = self._live.setdefault(step.request_id, _Recording(prompt_tokens=prompt_tokens))
            rec.experts.append(step.experts.numpy())
            rec.weights.append(step.weights.to(dtype=torch.float16).numpy())

    def on_request_end(self, request_id: str, finish: str) -> None:
        """Close the request's recording (``finish``: eos, length, stop, cancelled, error)."""
        with self._lock:
            rec = self._live.pop(request_id, None)
            if rec is None or not rec.experts:
                return
            experts = np.concatenate(rec.experts, axis=0)
            weights = np.concatenate(rec.weights, axis=0)
            tokens = int(experts.shape[0])
            self._done.append(
                (
                    {
                        "request_id": request_id,
                        "prompt_len": rec.prompt_tokens,
                        "n_rows": tokens,
                        "n_decode_tokens": tokens - rec.prompt_tokens,
                        "finish": finish,
                    },
                    experts,
                    weights,
                )
            )
            if len(self._done) - self._written >= self.every_requests:
                self._wake.notify()

    @property
    def requests(self) -> int:
        with self._lock:
            return len(self._done)

    # -- writer ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._closing and len(self._done) - self._written < self.every_requests:
                    self._wake.wait()
                if self._closing:
                    return
                done = list(self._done)
            self._write(done)

    def _write(self, done: list[tuple[dict[str, Any], np.ndarray, np.ndarray]]) -> None:
        if not done:
            return
        with self._write_lock:  # flush() and the writer thread share the tmp file
            self._write_locked(done)

    def _write_locked(self, done: list[tuple[dict[str, Any], np.ndarray, np.ndarray]]) -> None:
        requests = [TraceRequest(e, w, int(m["prompt_len"]), m) for m, e, w in done]
        write_trace(self.path, requests, self.meta)
        with self._lock:
            self._written = max(self._written, len(done))
            self.files_written += 1
        logger.info("trace %s: %d requests, %d tokens", self.path, len(done), sum(len(e) for _, e, _ in done))

    def flush(self) -> None:
        """Write every finished request now (from the caller's thread)."""
        with self._lock:
            done = list(self._done)
        self._write(done)

    def close(self) -> None:
        """Stop the writer and write the final file (requests still live are left out)."""
        with self._lock:
            self._closing = True
            self._wake.notify_all()
        self._thread.join()
        self.flush()
