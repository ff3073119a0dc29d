"""Routing traces: the one reader and the one writer of the ``.npz`` trace format.

A trace records which experts every token of a set of requests was routed to, layer by layer.
Compute's recorder writes it (``compute_svc.engine.trace_recorder``), forced routing reads it
(``replay.forced_routing``), ``expertcache feed-trace`` sends it to a predictor
(``expertcache.feed_trace``), and the benchmarks replay it (``bench.replay``, ``bench.predict_bench``).

Format (``np.load(path, allow_pickle=False)``; every key a plain array, no pickles):

==================  ======================================  ================================================
key                 dtype, shape                            meaning
==================  ======================================  ================================================
``expert_ids``      int8 ``[rows, layers, top_k]``          routed experts (int16 above 127 experts); within
                                                            a row by descending router weight
``gate_weights``    float16 ``[rows, layers, top_k]``       router weights of those experts (optional: a
                                                            trace without them reads as uniform ``1/top_k``)
``req_offsets``     int64 ``[requests + 1]``                request r owns rows ``req_offsets[r]:[r + 1]``
``decode_start``    int32 ``[requests]``                    first decode row within each request (the rows
                                                            before it are prompt tokens); optional, 0
``meta_json``       0-d str                                 JSON object; ``num_experts`` (required),
                                                            ``num_layers``, ``top_k``, ``model`` ...
``req_meta_json``   0-d str                                 JSON list, one object per request (optional)
==================  ======================================  ================================================

``layers`` are MoE layer indices (the model's MoE layers in order, ``expertcache.layers``), not
decoder layer numbers. Example: a request of 3 prompt tokens and 2 decode rows at offset 10 has
``req_offsets[r] = 10``, ``req_offsets[r + 1] = 15``, ``decode_start[r] = 3``; its decode rows
are 13 and 14.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

REQUIRED_KEYS = ("expert_ids", "req_offsets", "meta_json")
INT8_MAX_EXPERTS = 127  # int8 holds expert ids 0..127; larger models are stored as int16
# Bounds on what a file may claim, so that a corrupt one cannot make a reader allocate wildly.
MAX_LAYERS = 1 << 12
MAX_EXPERTS = 1 << 15
MAX_TOP_K = 1 << 10


class TraceError(ValueError):
    """A trace file is missing, unreadable or not in the trace format; the message names the file
    and what is wrong."""


@dataclass(frozen=True)
class RoutingTrace:
    """A routing trace in memory (see the module docstring for the format)."""

    path: str
    expert_ids: np.ndarray  # [rows, layers, top_k] int8 / int16
    gate_weights: np.ndarray  # [rows, layers, top_k] float16 / float32
    req_offsets: np.ndarray  # [requests + 1] int64
    decode_start: np.ndarray  # [requests] int64
    num_experts: int
    meta: dict[str, Any] = field(default_factory=dict)
    has_gate_weights: bool = True  # False: the file had none, ``gate_weights`` is uniform

    @property
    def num_layers(self) -> int:
        """MoE layers per row."""
        return int(self.expert_ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.expert_ids.shape[2])

    @property
    def num_requests(self) -> int:
        return len(self.req_offsets) - 1

    @property
    def num_rows(self) -> int:
        return int(self.expert_ids.shape[0])

    @property
    def model(self) -> str:
        return str(self.meta.get("model", Path(self.path).stem))

    def shape_text(self) -> str:
        return f"{self.num_layers} MoE layers x {self.num_experts} experts, top-{self.top_k}"

    def rows(self, request: int) -> tuple[int, int]:
        """[start, end) rows of ``request`` (prompt and decode)."""
        return int(self.req_offsets[request]), int(self.req_offsets[request + 1])

    def decode_rows(self, request: int) -> tuple[int, int]:
        """[start, end) rows of ``request``'s decode tokens."""
        start, end = self.rows(request)
        return min(end, start + int(self.decode_start[request])), end

    def request(self, request: int) -> np.ndarray:
        """``[tokens, layers, top_k]`` experts of ``request`` (prompt and decode rows)."""
        start, end = self.rows(request)
        return self.expert_ids[start:end]

    def decode_only(self) -> RoutingTrace:
        """The same trace without prompt rows (every ``decode_start`` 0); itself if it has none."""
        if not np.any(self.decode_start):
            return self
        keep = np.zeros(self.num_rows, bool)
        lengths = []
        for r in range(self.num_requests):
            start, end = self.decode_rows(r)
            keep[start:end] = True
            lengths.append(end - start)
        offsets = np.zeros(self.num_requests + 1, np.int64)
        offsets[1:] = np.cumsum(lengths)
        return replace(
            self,
            expert_ids=self.expert_ids[keep],
            gate_weights=self.gate_weights[keep],
            req_offsets=offsets,
            decode_start=np.zeros(self.num_requests, np.int64),
        )


def read_trace(path: str | Path) -> RoutingTrace:
    """Read and check ``path``; ``TraceError`` names the file and the first thing wrong."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"trace {path} does not exist")
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise TraceError(f"trace {path} is not a routing trace (.npz): {exc}") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise TraceError(f"trace {path} is a single .npy array, not an .npz archive")
    with z:
        missing = [k for k in REQUIRED_KEYS if k not in z.files]
        if missing:
            raise TraceError(f"trace {path} lacks {missing} (has {sorted(z.files)})")
        try:
            expert_ids = z["expert_ids"]
            offsets = z["req_offsets"]
            meta = json.loads(str(z["meta_json"]))
            weights = z["gate_weights"] if "gate_weights" in z.files else None
            decode_start = z["decode_start"] if "decode_start" in z.files else None
        except (OSError, ValueError, EOFError) as exc:  # json.JSONDecodeError is a ValueError
            raise TraceError(f"trace {path}: {exc}") from None
    if expert_ids.ndim != 3 or expert_ids.dtype.kind not in "iu" or 0 in expert_ids.shape[1:]:
        raise TraceError(
            f"trace {path}: expert_ids must be int [rows, layers, top_k], got {expert_ids.dtype} "
            f"{list(expert_ids.shape)}"
        )
    rows, layers, top_k = expert_ids.shape
    if layers > MAX_LAYERS or top_k > MAX_TOP_K:
        raise TraceError(
            f"trace {path}: {layers} layers x top-{top_k} exceeds the bounds ({MAX_LAYERS} layers, top-{MAX_TOP_K})"
        )
    if not isinstance(meta, dict):
        raise TraceError(f"trace {path}: meta_json must be a JSON object")
    num_experts = meta.get("num_experts")
    if (
        not isinstance(num_experts, int)
        or isinstance(num_experts, bool)
        or not 1 <= num_experts <= MAX_EXPERTS
    ):
        raise TraceError(
            f"trace {path}: meta_json must give num_experts as an int in [1, {MAX_EXPERTS}], got {num_experts!r}"
        )
    if top_k > num_experts:
        raise TraceError(f"trace {path}: top_k {top_k} exceeds num_experts {num_experts}")
    if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or len(offsets) < 2:
        raise TraceError(
            f"trace {path}: req_offsets must be int [requests + 1], got shape {list(offsets.shape)}"
        )
    offsets = offsets.astype(np.int64)
    if offsets[0] != 0 or offsets[-1] != rows or np.any(np.diff(offsets) < 0):
        raise TraceError(
            f"trace {path}: req_offsets must rise from 0 to {rows} (its rows), got {offsets[0]}..{offsets[-1]}"
        )
    requests = len(offsets) - 1
    if decode_start is None:
        decode_start = np.zeros(requests, np.int64)
    elif decode_start.shape != (requests,) or decode_start.dtype.kind not in "iu":
        raise TraceError(
            f"trace {path}: decode_start must be int [{requests}] (one per request), got "
            f"{decode_start.dtype} {list(decode_start.shape)}"
        )
    decode_start = decode_start.astype(np.int64)
    if np.any(decode_start < 0) or np.any(decode_start > np.diff(offsets)):
        raise TraceError(f"trace {path}: a decode_start lies outside its request's rows")
    if expert_ids.size and (int(expert_ids.min()) < 0 or int(expert_ids.max()) >= num_experts):
        raise TraceError(
            f"trace {path}: expert_ids range {int(expert_ids.min())}..{int(expert_ids.max())} "
            f"is outside 0..{num_experts - 1} (num_experts)"
        )
    has_weights = weights is not None
    if weights is None:
        weights = np.full(expert_ids.shape, 1.0 / top_k, np.float32)
    elif weights.shape != expert_ids.shape or weights.dtype.kind != "f":
        raise TraceError(
            f"trace {path}: gate_weights must be float {list(expert_ids.shape)} like expert_ids, got "
            f"{weights.dtype} {list(weights.shape)}"
        )
    return RoutingTrace(
        str(path), expert_ids, weights, offsets, decode_start, int(num_experts), meta, has_weights
    )


@dataclass(frozen=True)
class TraceRequest:
    """One request to write: ``experts`` int [rows, layers, top_k], ``weights`` float [rows, layers,
    top_k], ``decode_start`` (its prompt rows) and a JSON-able ``meta`` object."""

    experts: np.ndarray
    weights: np.ndarray
    decode_start: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


def expert_dtype(num_experts: int) -> np.dtype:
    """int8 up to 127 experts, int16 above (the format's ``expert_ids`` dtype)."""
    return np.dtype(np.int8 if num_experts <= INT8_MAX_EXPERTS else np.int16)


def write_trace(path: str | Path, requests: list[TraceRequest], meta: dict[str, Any]) -> None:
    """Write ``requests`` as one trace file at ``path``, atomically (``path.tmp``, fsync, rename).

    ``meta`` must hold ``num_layers`` (MoE layers), ``num_experts`` and ``top_k``; the file's
    ``meta_json`` adds ``expert_ids_dtype``. ``ValueError`` names what does not fit."""
    for key in ("num_layers", "num_experts", "top_k"):
        if key not in meta:
            raise ValueError(f"trace meta lacks {key!r}")
    if not requests:
        raise ValueError("a trace needs at least one request")
    layers, top_k, num_experts = int(meta["num_layers"]), int(meta["top_k"]), int(meta["num_experts"])
    dtype = expert_dtype(num_experts)
    experts = np.concatenate([r.experts for r in requests], axis=0)
    weights = np.concatenate([r.weights for r in requests], axis=0).astype(np.float16)
    if experts.shape[1:] != (layers, top_k) or weights.shape != experts.shape:
        raise ValueError(
            f"routing rows have shape {experts.shape[1:]} (weights {weights.shape[1:]}), meta says ({layers}, {top_k})"
        )
    if experts.size and (int(experts.min()) < 0 or int(experts.max()) >= num_experts):
        raise ValueError(
            f"expert ids {int(experts.min())}..{int(experts.max())} outside 0..{num_experts - 1}"
        )
    offsets = np.zeros(len(requests) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(r.experts) for r in requests])
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        np.savez(
            f,
            expert_ids=experts.astype(dtype),
            gate_weights=weights,
            req_offsets=offsets,
            decode_start=np.array([r.decode_start for r in requests], dtype=np.int32),
            meta_json=np.array(json.dumps({**meta, "expert_ids_dtype": dtype.name})),
            req_meta_json=np.array(json.dumps([r.meta for r in requests])),
        )
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    logger.debug("trace %s: %d requests, %d rows", path, len(requests), len(experts))


__all__ = [
    "INT8_MAX_EXPERTS",
    "RoutingTrace",
    "TraceError",
    "TraceRequest",
    "expert_dtype",
    "read_trace",
    "write_trace",
]
