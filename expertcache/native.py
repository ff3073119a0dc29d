"""Thin wrapper over the ``expertcache._native`` extension built from ``csrc/`` by the package build.

The extension is installed inside this package (``pip install .``, or ``make install`` in a
checkout, which installs the checkout in editable mode); ``FEATURES`` says which optional fast
paths it was built with. Exceptions come from C++:
``IndexError`` (entry/slot index out of range), ``ValueError`` (bad argument, bad slot-table
file, double free), ``RuntimeError`` (illegal state transition, pool exhausted, system error);
messages name the slot table where there is one.

``SlotTable`` (shared memory, version 6, one entry per ``(layer, expert)`` index; the layout, the
pin protocol and what the daemon trusts are written up in csrc/include/expertcache/slot_table.h).
The daemon's handle: ``create(name, num_entries, num_slots, num_clients=32, max_demand=0,
ring_bytes=128 KiB)`` (memfds, no file); ``begin_load(e, slot)``, ``finish_load(e)``,
``abort_load(e)``, ``try_evict(e) -> bool``, ``hold(e, n)`` and ``unpin_many`` (its own pins);
client ledgers: ``claim_channel(c) -> epoch`` (a new region), ``table_fd()``, ``client_fd(c)``
(descriptors for the handoff), ``hold_for_client(c, epoch, e)``, ``unhold_for_client(c, epoch,
e)``, ``reclaim_client(c) -> int``, ``audit_client(c) -> (pinned, stray)``, ``client_epoch(c)``,
``client_pins(c, e)``; recency ``accessed_since(since) -> (entries, until)``, ``hits``;
``state(e)`` (a ``TableState`` value), ``pins(e)``, ``slot(e)``, ``generation(e)`` from its private
record. Compute's handle: ``attach(table_fd, region_fd, c, epoch)`` (the table read-only, its own
region read-write; ``StaleClient`` once its ledger was reclaimed); ``try_pin(e) -> int | None``,
``unpin(e)``, batch ``try_pin_many(entries) -> list[int]`` (slot or -1) and ``unpin_many(entries)``
(the hit path), ``wait_resident(e, timeout_s) -> bool`` (releases the GIL),
``resident_slots(entries)`` (slot, -1 loading, -2 absent). Client channels (compute's demands and
signals in its region, csrc/include/expertcache/channel.h): ``channel(c) -> ClientChannel``;
``signals_wanted`` (read by compute, set by the daemon). ``LayerSignals(channel, handles, tokens,
top_k, layers, depth, ahead)``: a decode step's route and lookahead records, written natively per
layer by ``ExpertFfn.run_layers`` (csrc/include/expertcache/layer_signals.h); ``written``,
``dropped``. ``SpanDemand(channel, timeout_s, deadline_s, spin_s, reply_grace_s, landing_grace_s,
gather)``: the demands a span of ``ExpertFfn.run_layers`` posts and waits for itself
(csrc/python/span_demand.h); ``stop()`` (another thread), ``sources``, ``waits``, ``handed_back``.

``HostPool(num_slots, slot_bytes, pin=False)``: 4 KiB-aligned slots, registered with CUDA when
``pin`` (``RuntimeError`` when it cannot be); ``alloc() -> int``, ``free(i)``, ``view(i) ->
memoryview``, ``base_address``, ``slot_address(i)``, ``stride``, ``num_free``, ``pinned``.
"""

from __future__ import annotations

from enum import IntEnum

try:
    from expertcache import _native
except ImportError as exc:  # pragma: no cover - an install without its build
    raise ImportError(
        f"the native core expertcache._native cannot be loaded ({exc}); it is built by the package "
        "build: `pip install .`, or `make install` in a checkout"
    ) from exc

# The optional features this build has (CMakeLists.txt): "io_uring", "isa-l", "cuda".
FEATURES: frozenset[str] = frozenset(_native.FEATURES)
# What each feature gives, and what runs instead when the build lacks it.
_FALLBACKS = {
    "io_uring": ("store reads through io_uring", "store reads through a pread thread pool (no liburing)"),
    "isa-l": (
        "CRC-32 by ISA-L",
        "CRC-32 by the core's carry-less multiply (no ISA-L)"
        if _native.CRC32_IMPL == "pclmul"
        else "CRC-32 by zlib (no ISA-L, no PCLMULQDQ)",
    ),
    "cuda": ("CUDA path", "no CUDA path (built without nvcc)"),
}


def build_summary() -> str:
    """One line naming what this build of the native core does, fallbacks included; the daemon
    logs it at start, so a build without the fast paths says so."""
    return "native core: " + "; ".join(
        on if name in FEATURES else off for name, (on, off) in _FALLBACKS.items()
    )


SlotTable = _native.SlotTable
ClientChannel = _native.ClientChannel
LayerSignals = _native.LayerSignals
SpanDemand = _native.SpanDemand
StaleClient = _native.StaleClient
MAX_REQUEST_ID_BYTES: int = _native.MAX_REQUEST_ID_BYTES
HostPool = _native.HostPool


class TableState(IntEnum):
    """An entry's state as the shared slot table stores it (``SlotTable.state``). EVICTING exists
    only inside the daemon's own eviction, under its lock; the residency reads it as RESIDENT."""

    ABSENT = _native.ABSENT
    LOADING = _native.LOADING
    RESIDENT = _native.RESIDENT
    EVICTING = _native.EVICTING


__all__ = [
    "FEATURES",
    "MAX_REQUEST_ID_BYTES",
    "ClientChannel",
    "HostPool",
    "LayerSignals",
    "TableState",
    "SlotTable",
    "SpanDemand",
    "StaleClient",
    "build_summary",
]

# ``Reader(threads=4, queue_depth=64, chunk_bytes=1 MiB, backend="auto", background_depth=0)``:
# asynchronous (O_DIRECT) file reads into raw addresses with priorities ``Reader.DEMAND`` (0) <
# ``Reader.LAYER_AHEAD`` (1) < ``Reader.PREFETCH`` (2), chunk pre-emption and CRC-32 checks;
# demand first: no LAYER_AHEAD or PREFETCH chunk is issued while a demand is queued or in flight,
# and at most ``background_depth`` of theirs are in flight (0: half the backend's concurrency);
# ``open_file``, ``submit``, ``wait`` (raises ``ReadError``, an ``OSError``; ``TimeoutError``),
# ``poll`` (``(id, tag, None or its ReadError, nbytes, elapsed_s)`` of requests submitted with
# ``pollable=True``, the default; the others are left to ``wait``), ``cancel``, ``promote``,
# ``event_fd`` (readable while ``poll`` has completions), ``pause``/``resume``, ``stats``, ``close``.
# See csrc/include/expertcache/reader.h.
Reader = _native.Reader
ReadError = _native.ReadError
# ``crc32(buffer) -> int``: zlib-compatible CRC-32 (GIL released); ``CRC32_IMPL`` names the
# implementation it uses here: "isa-l" (built with libisal), "pclmul" (the core's own carry-less
# multiply, on a CPU with PCLMULQDQ) or "zlib". ``crc32_by(impl, buffer, crc=0)`` runs one of
# "pclmul" and "zlib" by name (tests and benchmarks compare them).
crc32 = _native.crc32
crc32_by = _native.crc32_by
CRC32_IMPL: str = _native.CRC32_IMPL
READ_DEMAND = Reader.DEMAND
READ_LAYER_AHEAD = Reader.LAYER_AHEAD
READ_PREFETCH = Reader.PREFETCH
__all__ += [
    "CRC32_IMPL",
    "READ_DEMAND",
    "READ_LAYER_AHEAD",
    "READ_PREFETCH",
    "ReadError",
    "Reader",
    "crc32",
    "crc32_by",
]

# ``TransitionTable(layers, experts, prior_count, history_exponent, half_life_visits)``: the routing
# transitions of cache_daemon/decisions/transitions.py; ``step(layer, previous, current, history,
# out)``, ``predict(layer, previous, history) -> float32 [E]``, ``visits(layer)``.
# See csrc/include/expertcache/transitions.h.
TransitionTable = _native.TransitionTable
__all__ += ["TransitionTable"]

# ``request_estimates(history, history_long, next_p, hints, hint_token, token, has_hints, long_weight,
# transition_weight, hint_weight, hint_ttl_tokens, learned, out_long, out_next=None)``,
# ``apply_lookahead(p, num_experts, predictions)`` and ``next_use_layers(distance, p_next, p_long,
# moe_layers, floor, out)``: the activation signals' per-version estimates
# (cache_daemon/decisions/use_estimates.py) in one pass each, bit for bit its numpy expressions;
# ``idle_log_survival(distance, p_next, p_long, moe_layers, horizon, out)``: the activation-aware
# policy's eviction key, the log-probability that each entry goes unused over the horizon;
# ``victim_order(resident, next_use, stamp)``: the activation-aware policy's victims in order.
# See csrc/include/expertcache/use_estimates.h.
request_estimates = _native.request_estimates
apply_lookahead = _native.apply_lookahead
next_use_layers = _native.next_use_layers
idle_log_survival = _native.idle_log_survival
victim_order = _native.victim_order
__all__ += ["apply_lookahead", "idle_log_survival", "next_use_layers", "request_estimates", "victim_order"]

# ``NextVisitLogistic(weights, bias, window)``: the learned next-visit model's arithmetic
# (cache_daemon/decisions/next_visit.py); ``predict(layer, latest, short_history, long_history,
# out)``. See csrc/include/expertcache/next_visit.h.
NextVisitLogistic = _native.NextVisitLogistic
__all__ += ["NextVisitLogistic"]

# ``decode_mxfp4(blocks, scales, out, out_dtype, path="auto")`` and ``decode_fp8(values, scale_inv,
# block_rows, block_cols, out, out_dtype, path="auto")``: MXFP4 (uint8 blocks [R, G, 16] + scales
# [R, G]) and block-FP8 (the bytes of float8_e4m3fn [R, C] + float32 scale_inv) experts decoded on
# the CPU into ``out`` ("bfloat16" / "float16" as int16 bits, or "float32"; numpy views of torch
# tensors, no copy), bit for bit transformers' dequantisation, without the GIL; ``ValueError`` names
# a bad argument (dtype, shape, contiguity, the output's size). ``DECODE_PATHS``: the SIMD paths this
# CPU runs, fastest first ("avx512", "avx2", "portable"). expertcache.encodings calls them for CPU
# tensors. See csrc/include/expertcache/decode.h.
decode_mxfp4 = _native.decode_mxfp4
decode_fp8 = _native.decode_fp8
DECODE_PATHS: tuple[str, ...] = tuple(_native.DECODE_PATHS)
__all__ += ["DECODE_PATHS", "decode_fp8", "decode_mxfp4"]

# CUDA path (csrc/include/expertcache/cuda.h), present only when the extension was built with nvcc
# (``CUDA_BUILT``). ``cuda_device_count()`` (0 without driver/device), ``cuda_device_uuid(i)``
# ("GPU-<8-4-4-4-12 hex>"), ``cuda_device_for_uuid(uuid)`` (``ValueError`` listing visible UUIDs),
# ``CudaArena.allocate(device, num_slots, slot_bytes)`` / ``CudaArena.open(handle, gpu_uuid,
# num_slots, slot_bytes)`` with ``export_handle() -> bytes`` (64), ``slot_address(i)``, ``stride``
# (slot_bytes rounded up to 256 B), ``close()`` and ``__cuda_array_interface__`` ([num_slots,
# stride] uint8); ``CopyEngine(device, num_streams=2)`` with ``copy_h2d(dst, src, nbytes, stream=0)
# -> ticket``, ``query``, ``wait(ticket, timeout_s=-1)`` (``TimeoutError``), ``synchronize``.
# CUDA failures are ``RuntimeError("cudaXxx(...) failed: cudaErrorYyy: ...")``. Versions:
# ``cuda_driver_version()`` (12080 = 12.8; 0 without a driver), ``cuda_runtime_version()`` (of the
# statically linked runtime), ``cuda_driver_mismatch(v)`` (what a driver of version v lacks, "" if
# nothing; ``cuda_no_device_reason()`` includes it). ``cuda_device_numa_node(i)``: -1 if unknown.
CUDA_BUILT: bool = _native.CUDA_BUILT
__all__ += ["CUDA_BUILT", "cuda_available"]
if CUDA_BUILT:
    CudaArena = _native.CudaArena
    CopyEngine = _native.CopyEngine
    cuda_device_count = _native.cuda_device_count
    cuda_device_uuid = _native.cuda_device_uuid
    cuda_device_for_uuid = _native.cuda_device_for_uuid
    cuda_normalize_uuid = _native.cuda_normalize_uuid
    cuda_no_device_reason = _native.cuda_no_device_reason
    cuda_driver_version = _native.cuda_driver_version
    cuda_runtime_version = _native.cuda_runtime_version
    cuda_driver_mismatch = _native.cuda_driver_mismatch
    cuda_device_numa_node = _native.cuda_device_numa_node
    __all__ += [
        "CopyEngine",
        "CudaArena",
        "cuda_device_count",
        "cuda_device_for_uuid",
        "cuda_device_numa_node",
        "cuda_device_uuid",
        "cuda_driver_mismatch",
        "cuda_driver_version",
        "cuda_no_device_reason",
        "cuda_runtime_version",
        "cuda_normalize_uuid",
    ]


def cuda_available() -> bool:
    """True when the extension has the CUDA path and the CUDA runtime sees at least one device."""
    return CUDA_BUILT and _native.cuda_device_count() > 0


# ``ExpertFfn(spec)``: one MoE layer's experts fused on the CPU from their stored encoding
# (``run(arena, slots, bounds, rows, tokens, weights, x, out)``, ``set_threads``, ``path``); the spec
# is compute_svc.experts.fused.fused_spec's; its optional "path" names the SIMD path ("auto", the
# default, is the fastest). ``FFN_PATHS``: the paths this CPU runs, fastest first ("amx": "avx512"
# but MXFP4 in bfloat16 on AMX tiles from 5 rows an expert; "avx512-bf16": "avx512" but MXFP4 and
# plain bf16 [out, in] rows in bfloat16 by vdpbf16ps at every row count; "avx512": the AVX-512 kernels where
# there are some and the AVX2 ones elsewhere, "avx2", "portable"); ``ExpertFfn.amx_items``: the
# work items (16 output rows of one expert) run on AMX so far. See
# csrc/include/expertcache/expert_ffn.h.
ExpertFfn = _native.ExpertFfn
FFN_PATHS: tuple[str, ...] = tuple(_native.FFN_PATHS)


def expert_ffn(spec: dict, threads: int = 1) -> ExpertFfn:
    """A fused expert FFN for ``spec``, running on ``threads`` threads (the caller's included)."""
    ffn = ExpertFfn(spec)
    ffn.set_threads(max(1, int(threads)))
    return ffn


__all__ += ["FFN_PATHS", "ExpertFfn", "expert_ffn"]

# ``DecodeAttention(spec)``: the dense half of a decoder layer for decode steps on the CPU
# (``add_layer``, ``begin_step``, ``run(layer)``, ``end_step``); the spec is
# compute_svc.engine.decode_step's. See csrc/include/expertcache/decode_attention.h.
# ``router_top_k_supported(dtype, k)``: whether its spec may ask for the router's top k (and
# softmax) for ``dtype``, computed as torch computes them.
DecodeAttention = _native.DecodeAttention
router_top_k_supported = _native.router_top_k_supported

__all__ += ["DecodeAttention", "router_top_k_supported"]
