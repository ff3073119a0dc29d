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

Times come from the ``cpu-e2e`` timing model (``simulator.cpu_e2e_timing``) calibrated on the
run itself (``measured_timing``): the store's blob, a token's compute as the systems measured it
(its time less its wait for experts; the per-layer and per-token parts in the model's
proportions), a load's latency (a lone store read's, measured before the systems ran), ours'
lag of a prefetch behind its signal (the daemon's ``start_delay_seconds``), and the disk
(the rate of 4 reads in flight and a lone read's latency, both measured before the systems ran)
sped up or slowed down as a whole so that the simulated LRU takes the measured LRU's time
(``fit_disk``): LRU is the calibration point, ours (and ours' eviction alone,
``ours-eviction``, when it ran) is predicted. Without those figures only the bytes are a reference (no timing). Byte counts of
demand-only policies do not depend on the timing at all. ``timing_errors`` compares the
simulated time per token with the measured one.

Example: 3 Generates of 96 tokens from trace request 0, 192 slots of 768 → the routes of rows
0..95 of requests 0, 1, 2; lru simulated 148.0 MiB per token (measured 148.0), belady 72.4.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from cache_daemon.decisions.next_visit import NextVisitModel
from cache_daemon.decisions.next_visit import read as read_next_visit
from cache_daemon.decisions.scheduler import DEFAULT_INFLIGHT_BLOBS, PrefetchConfig
from expertcache.manifest import StoreManifest
from replay.forced_routing import ForcedRouting, load_trace
from replay.simulator import Simulation, TimingModel, cpu_e2e_timing

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
    timing: TimingModel | None,
    eviction_only: dict[str, Path | None] | None = None,
    prefetch_config: PrefetchConfig | None = None,
) -> dict[str, dict]:
    """Per simulated system (``lru``, ``belady``, ``oracle-next-token``, then each of ``ours``:
    name → its next-visit model file or None for the transitions, then each of
    ``eviction_only``: ours' eviction with that model, demand fetching only) its
    ``bytes_per_token``, ``hit_rate``, ``latency_ms_per_token`` (under ``timing``; None without
    one: bytes only) and ``prefetches_per_token``. The oracle estimates beyond the next token as
    ``ours`` does (with its model, the first of ``ours`` given). ``prefetch_config``: ours'
    scheduler settings (None: the daemon's defaults), e.g. the bar the e2e's daemon ran under."""
    n = manifest.num_blobs
    if not 1 <= slots <= n:
        raise ValueError(f"slots must be in [1, {n}], got {slots}")
    calibrated = timing is not None
    if timing is None:  # the decisions need a clock; the bytes do not depend on it
        timing = replace(
            cpu_e2e_timing(len(manifest.moe_layers), manifest.top_k), expert_bytes=manifest.blob_bytes
        )
    models = {name: None if path is None else read_next_visit(path) for name, path in ours.items()}
    runs: list[tuple[str, str, NextVisitModel | None, tuple[float, ...] | None, bool]] = [
        ("lru", "lru", None, None, False),
        ("belady", "belady", None, None, False),
        ("oracle-next-token", "oracle-next-token", next(iter(models.values()), None), None, False),
    ]
    for name, model in models.items():
        runs.append((name, "activation-aware", model, lookahead_accuracy, True))
    for name, path in (eviction_only or {}).items():
        runs.append((name, "activation-aware", None if path is None else read_next_visit(path), None, False))
    out: dict[str, dict] = {}
    for name, policy, model, lookahead, prefetch in runs:
        s = _summary(
            routes,
            manifest,
            slots,
            timing,
            policy,
            model,
            lookahead,
            prefetch=prefetch,
            config=prefetch_config,
        )
        out[name] = {
            "policy": policy,
            "bytes_per_token": s["bytes_per_token"],
            "hit_rate": s["hit_rate"],
            "latency_ms_per_token": s["latency_ms_per_token"] if calibrated else None,
            "prefetches_per_token": s["prefetches_per_token"],
            "slots": s["slots"],
        }
    return out


def _summary(
    routes: ForcedRoutes,
    manifest: StoreManifest,
    slots: int,
    timing: TimingModel,
    policy: str,
    model: NextVisitModel | None = None,
    lookahead: tuple[float, ...] | None = None,
    *,
    prefetch: bool = True,
    config: PrefetchConfig | None = None,
) -> dict:
    """One simulated run; ``prefetch`` False: demand fetching only (no lookahead, no EAMC),
    else under the scheduler's ``config`` (None: the defaults)."""
    sim = Simulation(
        routes.expert_ids,
        routes.gate_weights,
        routes.offsets,
        manifest.num_experts,
        timing,
        policy,
        slots / manifest.num_blobs,
        lookahead_accuracy=lookahead,
        next_visit_model=model,
        max_inflight_bytes=DEFAULT_INFLIGHT_BLOBS * manifest.blob_bytes,
        prefetch_config=config if prefetch else PrefetchConfig(layer_ahead=False, eamc=False),
    )
    return sim.run().summary(timing)


def measured_timing(
    manifest: StoreManifest,
    *,
    link_bytes_per_s: float,
    compute_s_per_token: float,
    read_latency_s: float = 0.0,
    decision_lag_s: float = 0.0,
) -> TimingModel:
    """The ``cpu-e2e`` timing model calibrated on an e2e run: ``manifest``'s blob over a link of
    ``link_bytes_per_s`` (the store's reads, 4 in flight; ``fit_disk`` scales it with the
    latency), each load usable no sooner than ``read_latency_s`` after its start (a lone read's
    latency, measured; loads in flight together overlap it), prefetches starting
    ``decision_lag_s`` after the change that asked for them (ours' daemon, measured), and one token's compute taking
    ``compute_s_per_token`` (a token's time less its wait for experts, as measured), split per
    layer (attention, each expert, overhead) and per token in the proportions of the model's own
    constants."""
    if link_bytes_per_s <= 0 or compute_s_per_token <= 0:
        raise ValueError(
            f"the link's rate and the compute per token must be > 0, got {link_bytes_per_s} and {compute_s_per_token}"
        )
    if read_latency_s < 0 or decision_lag_s < 0:
        raise ValueError(
            f"the read latency and the decision lag must be >= 0, got {read_latency_s} and {decision_lag_s}"
        )
    base = cpu_e2e_timing(len(manifest.moe_layers), manifest.top_k)
    f = compute_s_per_token / base.all_resident_token_s
    return replace(
        base,
        expert_bytes=manifest.blob_bytes,
        link_bytes_per_s=link_bytes_per_s,
        attention_s=base.attention_s * f,
        expert_s=base.expert_s * f,
        layer_overhead_s=base.layer_overhead_s * f,
        token_overhead_s=base.token_overhead_s * f,
        read_latency_s=read_latency_s,
        decision_lag_s=decision_lag_s,
        name="cpu-e2e, measured",
        notes=(
            f"expert: the store's blob, {manifest.blob_bytes} bytes",
            f"link: the store's reads, 4 in flight, {link_bytes_per_s / 1e9:.2f} GB/s (measured before the systems ran)",
            f"a load usable no sooner than {read_latency_s * 1e3:.2f} ms after its start (a lone read's latency, "
            "measured; loads in flight together overlap it)",
            f"a prefetch decision runs {decision_lag_s * 1e3:.3f} ms after the change that asked for it (ours' daemon: "
            "its mean start delay, measured)",
            f"compute: {compute_s_per_token * 1e3:.1f} ms a token (measured: a token's time less its wait for experts), split as "
            f"cpu-e2e's constants: per layer {base.layer_s * f * 1e3:.3f} ms, per token "
            f"{base.token_overhead_s * f * 1e3:.2f} ms",
        ),
    )


def fit_disk(
    routes: ForcedRoutes,
    manifest: StoreManifest,
    slots: int,
    timing: TimingModel,
    lru_ms_per_token: float,
    *,
    steps: int = 12,
) -> TimingModel:
    """``timing`` with its disk sped up or slowed down as a whole, so that the simulated LRU takes
    ``lru_ms_per_token`` (the measured one): the link's rate times a factor and the read latency
    divided by it. The disk measured before the systems ran is not the disk they ran on (its rate
    drifts by 2x and more from one run to the next on a cloud volume), and a miss costs the daemon's
    read, checksum, publication and compute's wake-up besides; scaling the rate alone while the
    latency stays as measured would turn a disk measured slow into a model bound by latency,
    which loads in flight together overlap, and so overstate what a prefetch that overlaps them
    buys. Bisection on the factor between 1/8 and 8 (LRU's time falls as it rises); at a bound,
    the bound. LRU is then the calibration point, and the other systems are predicted."""
    if lru_ms_per_token <= 0:
        raise ValueError(f"lru_ms_per_token must be > 0, got {lru_ms_per_token}")

    def scaled(factor: float) -> TimingModel:
        return replace(
            timing,
            link_bytes_per_s=timing.link_bytes_per_s * factor,
            read_latency_s=timing.read_latency_s / factor,
        )

    def lru_ms(factor: float) -> float:
        return _summary(routes, manifest, slots, scaled(factor), "lru")["latency_ms_per_token"]

    lo, hi = 1 / DISK_FIT_BOUND, DISK_FIT_BOUND
    if lru_ms(hi) >= lru_ms_per_token:
        factor = hi  # slower than the model at its fastest disk: the compute part is short
    elif lru_ms(lo) <= lru_ms_per_token:
        factor = lo
    else:
        for _ in range(steps):
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if lru_ms(mid) > lru_ms_per_token else (lo, mid)
        factor = (lo * hi) ** 0.5
    fitted = scaled(factor)
    bound = " (the bound)" if factor in (DISK_FIT_BOUND, 1 / DISK_FIT_BOUND) else ""
    return replace(
        fitted,
        notes=(
            *timing.notes,
            f"disk fitted to lru's measured {lru_ms_per_token:.1f} ms a token: {factor:.2f}x as fast as measured "
            f"before the systems ran{bound}, {fitted.link_bytes_per_s / 1e9:.2f} GB/s and a read latency of "
            f"{fitted.read_latency_s * 1e3:.2f} ms",
        ),
    )


# How far the fitted disk may stray from the one measured before the systems ran, either way.
DISK_FIT_BOUND = 8.0


# The simulator predicts the measured time per token this closely, or it is not trusted.
TIMING_TOLERANCE = 0.10


def timing_errors(measured: dict[str, dict], simulated: dict[str, dict]) -> dict | None:
    """How far the simulated time per token is from the measured one, for each system simulated
    and measured (``ms_per_token``: the measured mean, every token of its Generates), and whether
    the simulator orders them as measured: ``{"systems": {name: {"measured_ms", "simulated_ms",
    "error"}}, "same_order", "within_tolerance"}``; None without two such systems."""
    rows = {}
    for name, sim in simulated.items():
        got = measured.get(name, {}).get("ms_per_token")
        if got and sim.get("latency_ms_per_token"):
            rows[name] = {
                "measured_ms": got,
                "simulated_ms": sim["latency_ms_per_token"],
                "error": sim["latency_ms_per_token"] / got - 1.0,
            }
    if len(rows) < 2:
        return None
    by_measured = sorted(rows, key=lambda k: rows[k]["measured_ms"])
    by_simulated = sorted(rows, key=lambda k: rows[k]["simulated_ms"])
    return {
        "systems": rows,
        "same_order": by_measured == by_simulated,
        "within_tolerance": all(abs(r["error"]) <= TIMING_TOLERANCE for r in rows.values()),
        "tolerance": TIMING_TOLERANCE,
    }


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


__all__ = [
    "DISK_FIT_BOUND",
    "TIMING_TOLERANCE",
    "ForcedRoutes",
    "fit_disk",
    "forced_routes",
    "measured_timing",
    "shares",
    "simulate",
    "timing_errors",
]
