"""Routing trace files (the ``.npz`` format of ``expertcache.trace``) written for tests."""

from __future__ import annotations

import json

import numpy as np


def write_trace(path, lengths, *, layers=3, experts=8, top_k=2, decode_start=None, seed=0):
    """Random routes, ``lengths[i]`` rows for request i (each row a distinct top-k per layer,
    normalised float16 gate weights); decode starts at ``decode_start`` (0 by default)."""
    rng = np.random.default_rng(seed)
    rows = sum(lengths)
    ids = np.stack(
        [np.stack([rng.permutation(experts)[:top_k] for _ in range(layers)]) for _ in range(rows)]
    ).astype(np.int8)
    weights = rng.random((rows, layers, top_k)).astype(np.float16) + np.float16(0.1)
    weights = (weights / weights.sum(-1, keepdims=True)).astype(np.float16)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    starts = np.zeros(len(lengths), np.int32) if decode_start is None else np.asarray(decode_start, np.int32)
    meta = json.dumps({"num_layers": layers, "num_experts": experts, "top_k": top_k})
    np.savez(
        path, expert_ids=ids, gate_weights=weights, req_offsets=offsets, decode_start=starts, meta_json=meta
    )
    return path
