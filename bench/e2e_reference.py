"""``bench.e2e``'s simulated references: the trace replay's decision code on the e2e's own routing.

``bench.e2e`` measures ours and LRU in real processes, but Belady's MIN needs the future, so it
cannot run there. This module replays the very routing the e2e forces on its systems (the same
trace rows, taken by ``replay.forced_routing.ForcedRouting`` itself: request by request, row
0 for the prefill, wrapping past a request's end) through ``replay.simulator``
with the same number of slots:

- ``lru`` and ``belady``: demand fetching, no prefetch. LRU's simulated bytes are checked against
  its measured bytes (printed side by side); Belady's are the fewest any policy can load.
- ``oracle-next-token``: activation-aware eviction told the exact routing of the next token
  (``replay.oracle``), demand fetching: how far perfect short-term
  prediction could take eviction at all. No online predictor knows the next token exactly.
- ``ours`` (and ``ours-transitions``): the daemon's own policy, signals and prefetch scheduler with
  the e2e daemon's settings (activation-aware, the learned next-visit model or the transitions,
  lookahead modelled at the e2e's accuracy per depth, ``DEFAULT_INFLIGHT_BLOBS`` in flight): the
  replay's prediction of what the e2e measures.

Times come from the ``cpu-e2e`` timing model (``simulator.cpu_e2e_timing``, calibrated on this
machine for the bf16 experts of the e2e's default shape); at another precision or shape only the
bytes are a reference (``calibrated`` False), since the model's compute and blob times are not
that run's. Byte counts of demand-only policies do not depend on the timing at all.

Example: 3 Generates of 96 tokens from trace request 0, 192 slots of 768 → the routes of rows
0..95 of requests 0, 1, 2; lru simulated 148.0 MiB per token (measured 148.0), belady 72.4.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from cache_daemon.decisions.next_visit import NextVisitModel
from cache_daemon.decisions.next_visit import read as read_next_visit
from cache_daemon.decisions.scheduler import DEFAULT_INFLIGHT_BLOBS
from expertcache.manifest import StoreManifest
from replay.forced_routing import ForcedRouting, load_trace
from replay.simulator import CPU_E2E_EXPERT_BYTES, Simulation, cpu_e2e_timing

MIB = 1 << 20


@dataclass(frozen=True)
class ForcedRoutes:
    """The routing of ``count`` Generates of ``tokens`` tokens: ``expert_ids`` / ``gate_weights``
    int / float [count * tokens, layers, top_k], ``offsets`` [count + 1] (Generate g owns rows
    ``offsets[g]:offsets[g + 1]``), ``requests`` the trace request of each Generate."""

    expert_ids: np.ndarray
    gate_weights: np.ndarray
    offsets: np.ndarray
    requests: tuple[int, ...]


def forced_routes(
    trace_path: Path, manifest: StoreManifest, first_request: int, count: int, tokens: int
) -> ForcedRoutes:
    """What compute's forced routing feeds ``count`` Generates of ``tokens`` tokens each, from
    trace request ``first_request`` on (one forward per token: the prefill takes row 0)."""
    if count < 1 or tokens < 1:
        raise ValueError(f"count and tokens must be >= 1, got {count} and {tokens}")
    trace = load_trace(trace_path)
    routing = ForcedRouting(
        trace, manifest.moe_layers, manifest.num_experts, manifest.top_k, first_request=first_request
    )
    rows, requests = [], []
    for g in range(count):
        rid = f"reference-{g}"
        requests.append(routing.begin_request(rid))
        rows.extend(routing.row(rid, step) for step in range(tokens))
        routing.end_request(rid)
    idx = np.asarray(rows, np.int64)
    return ForcedRoutes(  # load_trace checked that the trace has gate_weights
        expert_ids=trace.expert_ids[idx].astype(np.int64),
        gate_weights=trace.gate_weights[idx].astype(np.float32),
        offsets=np.arange(count + 1, dtype=np.int64) * tokens,
        requests=tuple(requests),
    )


def simulate(
    routes: ForcedRoutes,
    manifest: StoreManifest,
    slots: int,
    *,
    ours: dict[str, Path | None],
    lookahead_accuracy: tuple[float, ...],
    calibrated: bool,
) -> dict[str, dict]:
    """Per simulated system (``lru``, ``belady``, ``oracle-next-token``, then each of ``ours``:
    name → its next-visit model file or None for the transitions) its ``bytes_per_token``,
    ``hit_rate``, ``latency_ms_per_token`` (None unless ``calibrated``) and
    ``prefetches_per_token``. The oracle estimates beyond the next token as ``ours`` does (with
    its model, the first of ``ours`` given)."""
    n = manifest.num_blobs
    if not 1 <= slots <= n:
        raise ValueError(f"slots must be in [1, {n}], got {slots}")
    timing = cpu_e2e_timing(len(manifest.moe_layers), manifest.top_k)
    timing = replace(timing, expert_bytes=manifest.blob_bytes)
    models = {name: None if path is None else read_next_visit(path) for name, path in ours.items()}
    runs: list[tuple[str, str, NextVisitModel | None, tuple[float, ...] | None]] = [
        ("lru", "lru", None, None),
        ("belady", "belady", None, None),
        ("oracle-next-token", "oracle-next-token", next(iter(models.values()), None), None),
    ]
    for name, model in models.items():
        runs.append((name, "activation-aware", model, lookahead_accuracy))
    out: dict[str, dict] = {}
    for name, policy, model, lookahead in runs:
        sim = Simulation(
            routes.expert_ids,
            routes.gate_weights,
            routes.offsets,
            manifest.num_experts,
            timing,
            policy,
            slots / n,
            lookahead_accuracy=lookahead,
            next_visit_model=model,
            max_inflight_bytes=DEFAULT_INFLIGHT_BLOBS * manifest.blob_bytes,
        )
        s = sim.run().summary(timing)
        out[name] = {
            "policy": policy,
            "bytes_per_token": s["bytes_per_token"],
            "hit_rate": s["hit_rate"],
            "latency_ms_per_token": s["latency_ms_per_token"] if calibrated else None,
            "prefetches_per_token": s["prefetches_per_token"],
            "slots": s["slots"],
        }
    return out


def is_calibrated(manifest: StoreManifest) -> bool:
    """Whether the ``cpu-e2e`` timing model is this store's: bf16 experts of the e2e's default
    shape (the blob is the experts' bytes plus the store's alignment)."""
    return manifest.encodings == ("plain",) and abs(manifest.blob_bytes - CPU_E2E_EXPERT_BYTES) < 64 * 1024


def shares(measured: dict[str, dict], simulated: dict[str, dict], system: str = "ours") -> dict | None:
    """``system``'s share of Belady's gain over LRU, in speed and in bytes: (ours - 1) / (belady - 1)
    with ours' speed-up measured (p50s) and Belady's simulated, and (1 - ours' bytes / lru's) over
    (1 - belady's / lru's), each side's ratio within its own kind (measured / simulated). None
    without the figures."""
    ours, lru = measured.get(system), measured.get("lru")
    sim_lru, sim_belady = simulated.get("lru"), simulated.get("belady")
    if not (ours and lru and sim_lru and sim_belady):
        return None
    out: dict = {}
    if ours.get("p50_s") and lru.get("p50_s") and sim_belady["latency_ms_per_token"]:
        ours_x = lru["p50_s"] / ours["p50_s"]
        belady_x = sim_lru["latency_ms_per_token"] / sim_belady["latency_ms_per_token"]
        out["speedup"] = ours_x
        out["belady_speedup"] = belady_x
        out["speed_share"] = (ours_x - 1.0) / (belady_x - 1.0) if belady_x > 1.0 else None
    if ours.get("bytes_per_token") is not None and lru.get("bytes_per_token"):
        ours_b = ours["bytes_per_token"] / lru["bytes_per_token"]
        belady_b = sim_belady["bytes_per_token"] / sim_lru["bytes_per_token"]
        out["bytes_ratio"] = ours_b
        out["belady_bytes_ratio"] = belady_b
        out["bytes_share"] = (1.0 - ours_b) / (1.0 - belady_b) if belady_b < 1.0 else None
    return out


__all__ = ["ForcedRoutes", "forced_routes", "is_calibrated", "shares", "simulate"]
