"""Store I/O benchmark: how close expert reads come to the disk, and what a cache hit costs.

    python -m bench.io_bench [--size-gib 1.5] [--repeats 3] [--chunk-mib 1,4] [--skip-daemon] ...
    make bench-io [BENCH_IO_ARGS="--size-gib 3"]

In one run, on one expert store on this disk (built once with the real converter from a random
mixtral checkpoint, cached under bench/.data/):

1. raw: sequential O_DIRECT reads of one big file (8 MiB reads, a few in flight, plain
   ``os.preadv`` threads): the disk's limit;
2. ours: the native ``Reader`` reading every expert blob of the store (all layers, all experts)
   into host-pool slots with the manifest's CRC-32 checked, cold (O_DIRECT), per backend;
3. safetensors: the same expert tensors in one safetensors file, ``safe_open(...).get_tensor`` +
   copy into a preallocated buffer, cold (the file is dropped from the page cache first with
   ``posix_fadvise(POSIX_FADV_DONTNEED)``);
4. ratios ours/raw (goal >= 0.90) and ours/safetensors (goal >= 2.0), PASS/FAIL as measured;
   then random experts read the way the daemon reads a miss (``random_expert_reads``: demand
   priority, CRC-checked, O_DIRECT), 1, 2, 4 and 8 in flight: the time one miss waits for the
   disk, and how far the disk overlaps reads (what ``bench.e2e`` prints its disk time from);
5. a cache-hit acquire + release of one layer's top_k experts: through the shared slot table
   directly (``try_pin_many``/``unpin_many``), through ``DaemonClient`` with the shm fast path,
   and through ``DaemonClient`` over gRPC only, against a real daemon on a tiny store
   (goal <= 20 us per layer for the shm path);
6. CRC-32 per implementation (the one in use, the core's own carry-less multiply, zlib) beside a
   memcpy of the same bytes, at one blob and at 4 MiB (``--crc-only``: this alone).

Paths 1-3 are measured ``--repeats`` times, interleaved, and their medians compared: the
bandwidth of a shared VM disk varies from run to run (and a host-side cache under the virtual
disk cannot be dropped from inside the guest). The verdict uses the daemon's configuration (auto
backend, the first ``--chunk-mib``); other chunk sizes and the pread backend are printed beside it.
Results also go to bench/results/io.json.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import math
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.report import DATA_DIR, GIB, MIB, RESULTS_DIR, say, write_json  # noqa: E402
from bench.stats import percentiles_us  # noqa: E402
from bench.threads import run_threads  # noqa: E402
from expertcache import native  # noqa: E402
from expertcache.manifest import MANIFEST_NAME, StoreManifest, read_manifest  # noqa: E402
from expertcache.native import HostPool, Reader, SlotTable  # noqa: E402

RESULTS = RESULTS_DIR / "io.json"
GOAL_RAW = 0.90
GOAL_SAFETENSORS = 2.0
GOAL_SHM_US = 20.0


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# -- the store --------------------------------------------------------------------------------------


def build_store(size_gib: float, hidden: int, intermediate: int, experts: int) -> tuple[Path, StoreManifest]:
    """A mixtral expert store of about ``size_gib`` of experts (bf16), built once and reused."""
    from cache_daemon.convert import convert
    from devtools.tiny import make_checkpoint

    expert_bytes = 3 * hidden * intermediate * 2
    layers = max(1, round(size_gib * GIB / (experts * expert_bytes)))
    root = DATA_DIR / f"mixtral-h{hidden}-i{intermediate}-e{experts}-l{layers}"
    store = root / "store"
    if (store / MANIFEST_NAME).exists():
        say(f"store: reusing {store}")
        return store, read_manifest(store)
    ckpt = root / "checkpoint"
    say(
        f"store: building a random mixtral checkpoint ({layers} layers x {experts} experts x "
        f"{expert_bytes / MIB:.1f} MiB, hidden {hidden}, intermediate {intermediate}, bf16) in {ckpt}"
    )
    started = time.perf_counter()
    make_checkpoint(
        "mixtral",
        ckpt,
        hidden_size=hidden,
        num_layers=layers,
        num_experts=experts,
        top_k=2,
        dtype=torch.bfloat16,
        intermediate_size=intermediate,
        with_tokenizer=False,
    )
    say(f"store: converting with cache_daemon.convert into {store}")
    manifest = convert(ckpt, store, progress=False)
    shutil.rmtree(ckpt)  # only the store is read below
    say(f"store: built in {time.perf_counter() - started:.1f} s")
    return store, manifest


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def build_safetensors(store: Path, manifest: StoreManifest) -> Path:
    """Every expert's tensors (``layers.L.experts.E.<name>``) in one safetensors file."""
    from safetensors.torch import save_file

    path = store.parent / "experts.safetensors"
    if path.exists():
        return path
    say(f"safetensors: writing the same expert tensors to {path}")
    tensors: dict[str, torch.Tensor] = {}
    for layer in manifest.moe_layers:
        data = (store / manifest.layer_files[layer]).read_bytes()
        for expert in range(manifest.num_experts):
            base = expert * manifest.blob_bytes
            for t in manifest.parts:
                raw = bytearray(data[base + t.offset : base + t.offset + t.nbytes])
                tensors[f"layers.{layer}.experts.{expert}.{t.name}"] = torch.frombuffer(
                    raw, dtype=getattr(torch, t.dtype)
                ).view(t.shape)
    tmp = path.with_suffix(".partial")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)
    return path


# -- 1. raw sequential O_DIRECT ------------------------------------------------------------------


def raw_sequential(path: Path, read_bytes: int, in_flight: int) -> tuple[int, float]:
    """Bytes read and seconds for sequential ``read_bytes`` reads of ``path`` with O_DIRECT,
    ``in_flight`` threads each with one read outstanding (os.preadv releases the GIL)."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    offsets = itertools.count(0, read_bytes)  # next() is atomic under the GIL
    totals = [0] * in_flight

    def worker(i: int) -> None:
        buf = mmap.mmap(-1, read_bytes)
        while (off := next(offsets)) < size:
            totals[i] += os.preadv(fd, [buf], off)
        buf.close()

    elapsed = run_threads([threading.Thread(target=worker, args=(i,)) for i in range(in_flight)])
    os.close(fd)
    return sum(totals), elapsed


# -- 2. ours ------------------------------------------------------------------------------------


def read_blobs(
    reader: Reader, store: Path, manifest: StoreManifest, keys, window: int, priority: int
) -> tuple[float, list[float]]:
    """The blobs of ``keys`` (in order) into ``window`` host-pool slots reused as reads complete,
    CRC-checked, at ``priority``; returns the seconds in all and each read's time from its
    submission to its completion. ``TimeoutError`` if no read completes within 30 s."""
    files = {
        layer: reader.open_file(str(store / manifest.layer_files[layer])) for layer in manifest.moe_layers
    }
    blob = manifest.blob_bytes
    pool = HostPool(window, blob)
    free = [pool.alloc() for _ in range(window)]
    submitted_at: dict[int, float] = {}  # slot -> when its read was submitted
    latencies: list[float] = []
    todo = iter(keys)

    def submit_more() -> None:
        while free:
            key = next(todo, None)
            if key is None:
                return
            slot = free.pop()
            submitted_at[slot] = time.perf_counter()
            reader.submit(
                files[key.layer],
                key.expert * blob,
                blob,
                pool.slot_address(slot),
                priority,
                expected_crc=manifest.checksums[key.layer][key.expert],
                tag=slot,
            )

    started = time.perf_counter()
    submit_more()
    while submitted_at:
        done = reader.poll(max_n=64, timeout_s=30.0)
        if not done:
            raise TimeoutError(f"no expert read of {store} completed within 30 s")
        for _rid, slot, error, _n, _elapsed in done:
            if error is not None:
                raise RuntimeError(f"native read failed: {error}")
            latencies.append(time.perf_counter() - submitted_at.pop(slot))
            free.append(slot)
        submit_more()
    return time.perf_counter() - started, latencies


def native_store_read(
    store: Path, manifest: StoreManifest, backend: str, threads: int, queue_depth: int, chunk_bytes: int
) -> tuple[int, float, dict]:
    """Every blob of the store into host-pool slots (a window of slots reused as reads complete),
    CRC-checked; returns bytes, seconds and the reader's stats."""
    reader = Reader(threads=threads, queue_depth=queue_depth, chunk_bytes=chunk_bytes, backend=backend)
    try:
        window = max(4, math.ceil(2 * queue_depth * chunk_bytes / manifest.blob_bytes))
        elapsed, _ = read_blobs(reader, store, manifest, manifest.all_keys(), window, Reader.PREFETCH)
        stats = reader.stats()
    finally:
        reader.close()
    return stats["bytes_read"], elapsed, stats


def demand_reads(
    store: Path,
    manifest: StoreManifest,
    keys,
    in_flight: int,
    *,
    threads: int = 4,
    queue_depth: int = 64,
    chunk_bytes: int = MIB,
) -> tuple[float, list[float]]:
    """``read_blobs`` of ``keys`` at demand priority through a native ``Reader`` of its own (the
    daemon's defaults), closed after."""
    reader = Reader(threads=threads, queue_depth=queue_depth, chunk_bytes=chunk_bytes)
    try:
        return read_blobs(reader, store, manifest, keys, in_flight, Reader.DEMAND)
    finally:
        reader.close()


def store_pass(store: Path, manifest: StoreManifest, *, in_flight: int = 4, threads: int = 4) -> dict:
    """Every blob of the store read once, layer by layer, the daemon's way (the native ``Reader``,
    O_DIRECT, CRC-checked), ``in_flight`` at a time. What lies beneath O_DIRECT (a virtual disk's
    host cache, a drive's own cache) then starts from the same state for every system measured
    after it, instead of favouring whichever reads second. Returns ``{"blobs", "bytes",
    "seconds", "gb_per_s"}``."""
    if in_flight < 1:
        raise ValueError(f"in_flight must be >= 1, got {in_flight}")
    keys = manifest.all_keys()
    seconds, _latencies = demand_reads(store, manifest, keys, min(in_flight, len(keys)), threads=threads)
    nbytes = len(keys) * manifest.blob_bytes
    return {"blobs": len(keys), "bytes": nbytes, "seconds": seconds, "gb_per_s": gbps(nbytes, seconds)}


def random_expert_reads(
    store: Path,
    manifest: StoreManifest,
    *,
    reads: int,
    in_flight: int,
    seed: int = 0,
    threads: int = 4,
    queue_depth: int = 64,
    chunk_bytes: int = MIB,
) -> dict:
    """``reads`` blobs of random experts (seeded; all layers), read as the daemon reads a miss:
    the native ``Reader`` with the daemon's defaults (auto backend, O_DIRECT, demand priority,
    CRC-32 checked), ``in_flight`` of them outstanding at a time (``read_blobs``).

    Returns ``{"reads", "in_flight", "blob_bytes", "bytes", "seconds", "gb_per_s",
    "latency_ms_p50"}``: the throughput of the whole batch and the median time from a read's
    submission to its completion. With ``in_flight`` 1 that median is what one demand miss waits
    for the disk; with more it shows how far the disk overlaps reads."""
    if reads < 1 or in_flight < 1:
        raise ValueError(f"reads and in_flight must be >= 1, got {reads} and {in_flight}")
    in_flight = min(in_flight, reads)
    keys = manifest.all_keys()
    picks = [keys[i] for i in np.random.default_rng(seed).integers(0, len(keys), size=reads)]
    blob = manifest.blob_bytes
    seconds, latencies = demand_reads(
        store, manifest, picks, in_flight, threads=threads, queue_depth=queue_depth, chunk_bytes=chunk_bytes
    )
    return {
        "reads": reads,
        "in_flight": in_flight,
        "blob_bytes": blob,
        "bytes": reads * blob,
        "seconds": seconds,
        "gb_per_s": gbps(reads * blob, seconds),
        "latency_ms_p50": statistics.median(latencies) * 1e3,
    }


# -- 3. safetensors -------------------------------------------------------------------------------


def safetensors_read(path: Path, manifest: StoreManifest) -> tuple[int, float]:
    from safetensors import safe_open

    drop_from_page_cache(path)
    pool = HostPool(1, manifest.blob_bytes)
    dest = torch.frombuffer(pool.view(pool.alloc()), dtype=torch.uint8)  # [blob_bytes] uint8
    total = 0
    started = time.perf_counter()
    with safe_open(str(path), framework="pt") as f:
        for key in manifest.all_keys():
            for t in manifest.parts:
                src = f.get_tensor(f"layers.{key.layer}.experts.{key.expert}.{t.name}")
                dest[t.offset : t.offset + t.nbytes].copy_(src.reshape(-1).view(torch.uint8))
                total += t.nbytes
    return total, time.perf_counter() - started


# -- 5. acquire + release -------------------------------------------------------------------------


def slot_table_hit(top_k: int, iterations: int) -> dict[str, float]:
    """try_pin_many + unpin_many of ``top_k`` resident entries of a shared-memory slot table."""
    owner = SlotTable.create(f"expertcache-bench-{os.getpid()}", 64, 16)
    epoch = owner.claim_channel(0)
    table_fd, region_fd = owner.table_fd(), owner.client_fd(0)
    table = SlotTable.attach(table_fd, region_fd, 0, epoch)  # compute's handle, as the handoff gives it
    os.close(table_fd)
    os.close(region_fd)
    entries = list(range(8, 8 + top_k))
    for slot, e in enumerate(entries):
        owner.begin_load(e, slot)
        owner.finish_load(e)
    samples = []
    clock = time.perf_counter_ns
    for _ in range(iterations):
        t0 = clock()
        slots = table.try_pin_many(entries)
        table.unpin_many(entries)
        samples.append(clock() - t0)
    assert all(s >= 0 for s in slots)
    return percentiles_us(samples)


def daemon_hit(work: Path, top_k: int, iterations: int, grpc_iterations: int) -> dict[str, dict]:
    """acquire + release of ``top_k`` resident experts through DaemonClient against a real daemon."""
    from cache_daemon.convert import convert
    from compute_svc.daemon.client import DaemonClient
    from devtools.launch import start_daemon
    from devtools.tiny import make_checkpoint

    store = DATA_DIR / "tiny-mixtral-store"
    if not (store / MANIFEST_NAME).exists():
        ckpt = work / "tiny-ckpt"
        make_checkpoint("mixtral", ckpt, num_experts=8, top_k=2, with_tokenizer=False)
        convert(ckpt, store, progress=False)
    manifest = read_manifest(store)
    layer = manifest.moe_layers[0]
    experts = list(range(min(top_k, manifest.num_experts)))
    daemon = start_daemon(
        store, work, device="cpu", device_budget_bytes=manifest.num_blobs * manifest.blob_bytes
    )
    results: dict[str, dict] = {}
    try:
        for name, fast_path, n in (
            ("shm_fast_path", True, iterations),
            ("grpc_demand", False, grpc_iterations),
        ):
            client = DaemonClient.connect(
                daemon.address, connect_timeout_s=30, acquire_timeout_s=30, fast_path=fast_path
            )
            try:
                for _ in range(3):  # load the experts, then they are cache hits
                    list(client.acquire(layer, experts))
                    client.release(layer, experts)
                samples = []
                clock = time.perf_counter_ns
                for _ in range(n):
                    t0 = clock()
                    ready = list(client.acquire(layer, experts))
                    client.release(layer, experts)
                    samples.append(clock() - t0)
                assert len(ready) == len(experts)
                results[name] = percentiles_us(samples)
            finally:
                client.close()
    finally:
        daemon.stop()
    return results


# -- main -----------------------------------------------------------------------------------------


def crc_speeds(nbytes: int, rounds: int = 7) -> dict[str, float]:
    """GB/s of CRC-32 over ``nbytes`` (warm in cache), per implementation this machine has, beside
    a memcpy of the same bytes on the same thread: the median of ``rounds`` interleaved rounds.
    ``in use`` is what the reader checks blobs with (``native.CRC32_IMPL``)."""
    data = os.urandom(nbytes)
    dest = bytearray(nbytes)
    src_buf = ctypes.create_string_buffer(data, nbytes)
    dest_buf = (ctypes.c_char * nbytes).from_buffer(dest)
    impls: dict[str, Callable[[], object]] = {f"in use ({native.CRC32_IMPL})": lambda: native.crc32(data)}
    try:
        native.crc32_by("pclmul", b"")
        impls["pclmul (the core's own)"] = lambda: native.crc32_by("pclmul", data)
    except ValueError:
        pass  # no PCLMULQDQ on this CPU
    impls["zlib"] = lambda: native.crc32_by("zlib", data)
    impls["memcpy of the same bytes"] = lambda: ctypes.memmove(dest_buf, src_buf, nbytes)
    reps = max(1, (64 * MIB) // nbytes)
    runs: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(rounds):
        for name, fn in impls.items():
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            runs[name].append(gbps(nbytes * reps, time.perf_counter() - start))
    return {name: statistics.median(r) for name, r in runs.items()}


def report_crc(sizes: list[int]) -> dict[str, dict[str, float]]:
    """Print [6], CRC-32 GB/s per implementation beside memcpy, for each size; return it."""
    say("[6] CRC-32 (the store's checksum) per implementation, warm buffers, one thread, beside memcpy")
    out = {}
    for nbytes in sizes:
        speeds = crc_speeds(nbytes)
        out[str(nbytes)] = speeds
        say(f"    {nbytes / MIB:.2f} MiB: " + ", ".join(f"{name} {v:.2f} GB/s" for name, v in speeds.items()))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.5, help="experts in the store, GiB (default 1.5)")
    ap.add_argument("--hidden", type=int, default=1024, help="mixtral hidden_size (default 1024)")
    ap.add_argument("--intermediate", type=int, default=2816, help="mixtral intermediate_size (default 2816)")
    ap.add_argument("--experts", type=int, default=8, help="experts per layer (default 8)")
    ap.add_argument("--threads", type=int, default=4, help="Reader threads (default 4)")
    ap.add_argument("--queue-depth", type=int, default=64, help="Reader io_uring queue depth (default 64)")
    ap.add_argument(
        "--chunk-mib",
        default="1,4",
        help="Reader chunk sizes to measure, MiB, comma-separated; the first (with the auto backend) "
        "is the one judged against the goals (default 1,4; 1 MiB is the daemon's default)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per path (default 3)")
    ap.add_argument("--raw-read-mib", type=int, default=8, help="raw test read size, MiB (default 8)")
    ap.add_argument("--raw-in-flight", type=int, default=4, help="raw test reads in flight (default 4)")
    ap.add_argument(
        "--random-reads", type=int, default=128, help="random expert reads per in-flight count (default 128)"
    )
    ap.add_argument("--top-k", type=int, default=4, help="experts per acquire (default 4)")
    ap.add_argument("--iterations", type=int, default=20000, help="shm acquire+release iterations")
    ap.add_argument("--grpc-iterations", type=int, default=1000, help="gRPC acquire+release iterations")
    ap.add_argument("--skip-daemon", action="store_true", help="skip the daemon round-trip measurements")
    ap.add_argument("--crc-only", action="store_true", help="measure the CRC-32 implementations only ([6])")
    args = ap.parse_args(argv)
    if args.crc_only:
        crc = report_crc([4 * MIB, 64 * 1024])
        write_json(RESULTS.with_name("io-crc.json"), {"crc32_gb_per_s": crc}, indent=2)
        return 0
    if not 1 <= args.random_reads <= 100_000:
        ap.error(f"--random-reads must be in [1, 100000], got {args.random_reads}")

    DATA_DIR.mkdir(parents=True, exist_ok=True)
    store, manifest = build_store(args.size_gib, args.hidden, args.intermediate, args.experts)
    st_path = build_safetensors(store, manifest)
    total = manifest.num_blobs * manifest.blob_bytes
    say(
        f"store: {store} - {len(manifest.moe_layers)} layers x {manifest.num_experts} experts x "
        f"{manifest.blob_bytes / MIB:.2f} MiB = {total / GIB:.2f} GiB"
    )
    backends = ["io_uring", "pread"] if Reader.uring_available()[0] else ["pread"]
    auto_backend = Reader(threads=1).backend
    chunks_mib = [int(c) for c in args.chunk_mib.split(",")]
    variants = [(b, c) for c in chunks_mib for b in backends]  # first: the verdict's configuration
    variants.sort(key=lambda v: (v != (auto_backend, chunks_mib[0]), chunks_mib.index(v[1])))

    # This disk's bandwidth varies from run to run (a shared VM disk): every path is measured
    # --repeats times, interleaved, and the medians are compared. Every read is cold: O_DIRECT, or
    # the safetensors file dropped from the page cache first.
    raw_runs: list[float] = []
    ours_runs: dict[str, list[float]] = {f"{b}/{c}MiB": [] for b, c in variants}
    ours_stats: dict[str, dict] = {}
    st_runs: list[float] = []
    for rep in range(1, args.repeats + 1):
        say(f"-- round {rep} of {args.repeats}")
        say(
            f"[1] raw O_DIRECT sequential: {st_path.name}, {args.raw_read_mib} MiB reads, "
            f"{args.raw_in_flight} in flight (os.preadv threads)"
        )
        n, s = raw_sequential(st_path, args.raw_read_mib * MIB, args.raw_in_flight)
        raw_runs.append(gbps(n, s))
        say(f"    {n / GIB:.2f} GiB in {s:.2f} s = {gbps(n, s):.2f} GB/s")
        for backend, chunk_mib in variants:
            name = f"{backend}/{chunk_mib}MiB"
            say(
                f"[2] ours: native Reader {backend}, {args.threads} threads, queue depth {args.queue_depth}, "
                f"{chunk_mib} MiB chunks, CRC-32 checked: every blob into host-pool slots, O_DIRECT"
            )
            n, s, stats = native_store_read(
                store, manifest, backend, args.threads, args.queue_depth, chunk_mib * MIB
            )
            ours_runs[name].append(gbps(n, s))
            ours_stats[name] = stats
            say(f"    {n / GIB:.2f} GiB in {s:.2f} s = {gbps(n, s):.2f} GB/s ({stats['chunks']} chunks)")
        say("[3] safetensors: safe_open().get_tensor + copy into a preallocated buffer, same experts")
        say(
            f"    cold: {st_path.name} dropped from the page cache with posix_fadvise(POSIX_FADV_DONTNEED) first"
        )
        n, s = safetensors_read(st_path, manifest)
        st_runs.append(gbps(n, s))
        say(f"    {n / GIB:.2f} GiB in {s:.2f} s = {gbps(n, s):.2f} GB/s")

    med = statistics.median
    raw_best = med(raw_runs)
    st = med(st_runs)
    verdict_name = f"{variants[0][0]}/{variants[0][1]}MiB"
    best = med(ours_runs[verdict_name])
    r_raw, r_st = best / raw_best, best / st
    verdict = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731
    fmt = lambda runs: " ".join(f"{r:.2f}" for r in runs)  # noqa: E731
    say("")
    say(f"{'read path (cold, ' + f'{total / GIB:.2f} GiB)':<46}{'median GB/s':>12}   runs")
    say(f"{'raw O_DIRECT sequential (limit)':<46}{raw_best:>12.2f}   {fmt(raw_runs)}")
    for name, runs in ours_runs.items():
        mark = " <- verdict" if name == verdict_name else ""
        say(f"{'ours: native Reader ' + name:<46}{med(runs):>12.2f}   {fmt(runs)}{mark}")
    say(f"{'safetensors get_tensor + copy':<46}{st:>12.2f}   {fmt(st_runs)}")
    say(f"ours/raw         = {r_raw:.2f}  (goal >= {GOAL_RAW:.2f})  {verdict(r_raw >= GOAL_RAW)}")
    say(
        f"ours/safetensors = {r_st:.2f}  (goal >= {GOAL_SAFETENSORS:.1f})  {verdict(r_st >= GOAL_SAFETENSORS)}"
    )
    say("")
    say(
        f"[4] random experts, read as the daemon reads a miss (Reader defaults, demand priority, "
        f"CRC-32 checked, O_DIRECT), {args.random_reads} per row"
    )
    random_reads = [
        random_expert_reads(store, manifest, reads=args.random_reads, in_flight=k, seed=k)
        for k in (1, 2, 4, 8)
    ]
    say(f"{'in flight':>10}{'p50 ms per read':>17}{'GB/s':>8}")
    for r in random_reads:
        say(f"{r['in_flight']:>10}{r['latency_ms_p50']:>17.2f}{r['gb_per_s']:>8.2f}")
    say("")
    say(f"[5] cache-hit acquire + release of {args.top_k} experts of one layer")
    hit = {"slot_table_try_pin_many": slot_table_hit(args.top_k, args.iterations)}
    if not args.skip_daemon:
        with tempfile.TemporaryDirectory(prefix="ecbench") as work:  # short: unix socket path limit
            hit.update(daemon_hit(Path(work), args.top_k, args.iterations // 4, args.grpc_iterations))
    say(f"{'path':<44}{'mean us':>10}{'p50 us':>10}{'p99 us':>10}")
    for name, r in hit.items():
        say(f"{name:<44}{r['mean_us']:>10.2f}{r['p50_us']:>10.2f}{r['p99_us']:>10.2f}")
    shm_p50 = hit.get("shm_fast_path", hit["slot_table_try_pin_many"])["p50_us"]
    say(
        f"shm path p50 = {shm_p50:.2f} us per layer (goal <= {GOAL_SHM_US:.0f} us)  {verdict(shm_p50 <= GOAL_SHM_US)}"
    )

    say("")
    crc = report_crc([manifest.blob_bytes, 4 * MIB])

    write_json(
        RESULTS,
        {
            "crc32_gb_per_s": crc,
            "store": {
                "path": str(store),
                "layers": len(manifest.moe_layers),
                "experts": manifest.num_experts,
                "blob_bytes": manifest.blob_bytes,
                "total_bytes": total,
            },
            "raw_o_direct": {
                "gb_per_s_runs": raw_runs,
                "gb_per_s_median": raw_best,
                "read_bytes": args.raw_read_mib * MIB,
                "in_flight": args.raw_in_flight,
            },
            "ours": {
                name: {
                    "gb_per_s_runs": runs,
                    "gb_per_s_median": med(runs),
                    "reader_stats": ours_stats[name],
                }
                for name, runs in ours_runs.items()
            },
            "ours_verdict_config": verdict_name,
            "safetensors": {
                "gb_per_s_runs": st_runs,
                "gb_per_s_median": st,
                "cold": "posix_fadvise DONTNEED",
            },
            "ratios": {"ours_over_raw": r_raw, "ours_over_safetensors": r_st},
            "random_expert_reads": random_reads,
            "goals": {
                "ours_over_raw": GOAL_RAW,
                "ours_over_safetensors": GOAL_SAFETENSORS,
                "shm_us": GOAL_SHM_US,
            },
            "acquire_release": hit,
            "top_k": args.top_k,
        },
        indent=2,
    )
    say(f"results: {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
