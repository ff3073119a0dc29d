"""The store tier: expert blobs read from the layer files with O_DIRECT (buffered where a
filesystem refuses it), checksum-verified, a demand read overtaking prefetch reads chunk by chunk
(docs/residency.md, "The store"). Reads run on the daemon's I/O threads, never on an RPC thread.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path

import numpy as np
import torch

from cache_daemon.errors import ChecksumMismatch, ShortRead, ShuttingDown, StoreIncomplete
from cache_daemon.metrics import DaemonMetrics
from cache_daemon.tiers.base import MemoryTier, Tier
from expertcache.errors import FailedPrecondition
from expertcache.keys import ExpertKey
from expertcache.manifest import StoreManifest, store_path
from expertcache.native import Reader, ReadError

logger = logging.getLogger(__name__)

IO_MODE_URING = "o_direct+io_uring"
IO_MODE_PREAD = "o_direct+pread"
IO_MODE_BUFFERED = "buffered"
_ALIGN = Reader.ALIGNMENT
# A contiguous CPU uint8 buffer a blob is read into.
BlobBuffer = torch.Tensor | memoryview | mmap.mmap | bytearray


class Priority(IntEnum):
    """Class of a store read; a lower value is read first (the native Reader's constants)."""

    DEMAND = Reader.DEMAND
    """A compute process is waiting for this expert now."""
    LAYER_AHEAD = Reader.LAYER_AHEAD
    """Predicted from the next layer's router: needed within a layer or two."""
    PREFETCH = Reader.PREFETCH
    """Predicted from the request's history or the EAMC: may never be used."""


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A zeroed, page-aligned, writable buffer of ``nbytes`` (anonymous mmap: always page-aligned)."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def as_writable(buf: BlobBuffer) -> memoryview:
    """A flat byte ``memoryview`` over ``buf`` (a contiguous CPU tensor of any dtype, or a buffer)."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("store reads need a contiguous CPU buffer")
        buf = buf.reshape(-1).view(torch.uint8).numpy()  # any dtype: the bytes are what we fill
    view = memoryview(buf)
    if view.readonly:
        raise ValueError("store reads need a writable buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _address(view: memoryview) -> int:
    """The address of the first byte of a writable, C-contiguous ``view``."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


@dataclass
class _LayerFile:
    rel: str  # path relative to the store, for messages
    path: Path
    file_id: int  # in the native Reader
    direct: bool
    fadvise_fd: int  # buffered files only (-1 otherwise): where DONTNEED is applied


@dataclass(eq=False, repr=False)
class StoreReadHandle:
    """One submitted blob read. ``wait`` must be called (once it returns or raises, the buffer is
    the caller's again); until then the destination buffer must stay alive and untouched."""

    _store: StoreReader
    key: ExpertKey
    _lf: _LayerFile
    _offset: int
    _out: memoryview  # [blob_bytes] uint8, the caller's buffer (kept alive until wait)
    _bounce: mmap.mmap | None  # page-aligned stand-in for an unaligned ``out`` of a direct file
    request_id: int
    priority: Priority
    owner: object = None  # a reaped read's owner: ``StoreReader.reap`` finishes it, never ``wait``
    _start: float = field(default_factory=time.perf_counter, init=False)
    _finished: bool = field(default=False, init=False)

    @property
    def state(self) -> dict[str, int | bool] | None:
        """The native request's ``{"priority", "queued", "done"}``; ``None`` once waited for."""
        return None if self._finished else self._store._reader.query(self.request_id)

    @property
    def done(self) -> bool:
        """Whether the read has finished (successfully or not) and ``wait`` will not block."""
        state = self.state
        return state is None or bool(state["done"])

    def promote(self, priority: Priority) -> bool:
        """Move the read to ``priority`` (a demand joining a prefetch): its unissued chunks go
        to the back of that class's queue. False when every chunk is already issued or done."""
        if self._finished or not self._store._reader.promote(self.request_id, int(priority)):
            return False
        self.priority = Priority(priority)
        return True

    def cancel(self) -> bool:
        """Drop the read's unissued chunks (a demand takes its buffer); ``wait`` then raises
        ``ShuttingDown`` once the chunks already issued have landed, and only then is the buffer
        free. False when nothing was left to cancel (the read completes normally)."""
        return not self._finished and bool(self._store._reader.cancel(self.request_id))

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until ``key``'s blob is in the buffer and verified (``None``: no time limit).

        Raises ``TimeoutError`` (the read goes on; call ``wait`` again), ``ShortRead`` or
        ``ChecksumMismatch`` (DATA_LOSS; the buffer then holds garbage), ``ShuttingDown`` if the
        store reader was closed first. Not for a read submitted ``reaped`` (``StoreReader.reap``
        finishes it).
        """
        if self._finished:
            raise FailedPrecondition(f"the read of expert {self.key} was already waited for")
        if self.owner is not None:
            raise FailedPrecondition(f"the read of expert {self.key} is finished by StoreReader.reap")
        try:
            self._store._reader.wait(self.request_id, timeout_s)
        except ReadError as exc:
            self._settle(exc)
        self._settle(None)

    def _settle(self, error: ReadError | None) -> None:
        """The read's completion, consumed: raise the daemon's error for ``error``, or finish the
        blob (the bounce copy, the page-cache hint, the metrics)."""
        self._finish()
        if error is not None:
            raise self._store._translate(self.key, self._lf, self._offset, error) from None
        nbytes = len(self._out)
        if self._bounce is not None:
            self._out[:] = memoryview(self._bounce)[:nbytes]
        if self._lf.fadvise_fd >= 0:
            try:
                os.posix_fadvise(self._lf.fadvise_fd, self._offset, nbytes, os.POSIX_FADV_DONTNEED)
            except OSError as exc:  # the store was closed in between: only a page-cache hint is lost
                logger.debug("posix_fadvise on %s after close: %s", self._lf.rel, exc)
        metrics = self._store._metrics
        metrics.store_read_seconds.inc(time.perf_counter() - self._start)
        metrics.store_read_bytes.inc(nbytes)
        metrics.tier["store"].hits.inc()

    def _finish(self) -> None:
        self._finished = True
        self._store._forget(self.request_id)


class StoreReader(MemoryTier):
    """Read-only ``MemoryTier`` over a store directory.

    ``read_into`` / ``submit`` fill a caller-owned buffer (the zero-copy path the daemon uses);
    ``get`` returns a fresh caller-owned tensor. Every read is checked against the manifest's
    CRC-32; a mismatch raises ``ChecksumMismatch`` (DATA_LOSS) and counts a checksum failure.
    Store blobs are immutable files, so ``pin``/``unpin`` only check presence, and
    ``put``/``remove`` refuse.

    ``io_threads``: pread workers (io_uring runs one thread, whatever it is); ``queue_depth``:
    reads in flight with io_uring; ``chunk_bytes``: the pre-emption granularity; ``backend``:
    ``"auto"``, ``"io_uring"`` or ``"pread"`` (see ``expertcache.native.Reader``);
    ``direct=False`` reads buffered (+ fadvise) even where O_DIRECT works.
    """

    tier = Tier.STORE

    def __init__(
        self,
        store_dir: str | Path,
        manifest: StoreManifest,
        metrics: DaemonMetrics,
        *,
        io_threads: int = 4,
        queue_depth: int = 64,
        chunk_bytes: int = 1 << 20,
        backend: str = "auto",
        direct: bool = True,
    ) -> None:
        self._store_dir = Path(store_dir)
        self._manifest = manifest
        self._metrics = metrics
        self._reader = Reader(
            threads=io_threads, queue_depth=queue_depth, chunk_bytes=chunk_bytes, backend=backend
        )
        self._lock = threading.Lock()  # guards _outstanding
        self._outstanding: dict[int, StoreReadHandle] = {}  # submitted, not yet waited for
        self._files: dict[int, _LayerFile] = {}
        self._closed = False
        self._direct = direct
        try:
            for layer in manifest.moe_layers:
                self._files[layer] = self._open(layer)
        except BaseException:
            self.close()
            raise
        logger.info("store %s: %d layer files, reads %s", self._store_dir, len(self._files), self.io_mode)

    def _open(self, layer: int) -> _LayerFile:
        rel = self._manifest.layer_files[layer]
        path = store_path(self._store_dir, rel, f"layer file (layer_files.{layer})")
        needed = self._manifest.num_experts * self._manifest.blob_bytes
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise StoreIncomplete(
                f"layer file {path} for layer {layer} is missing: {self._store_dir} is not a complete expert store"
            ) from None
        if size < needed:
            raise StoreIncomplete(
                f"layer file {path} has {size} bytes but layer {layer}'s {self._manifest.num_experts} "
                f"blobs need {needed}: the store is incomplete or truncated"
            )
        if self._direct:
            try:
                return _LayerFile(rel, path, self._reader.open_file(str(path), direct=True), True, -1)
            except ValueError as exc:  # the filesystem refuses O_DIRECT (EINVAL)
                logger.warning("%s; reading it buffered with posix_fadvise(DONTNEED)", exc)
        fadvise_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return _LayerFile(rel, path, self._reader.open_file(str(path), direct=False), False, fadvise_fd)
        except BaseException:
            os.close(fadvise_fd)
            raise

    @property
    def io_mode(self) -> str:
        """``"o_direct+io_uring"`` / ``"o_direct+pread"`` if every layer file is read with O_DIRECT
        (by that backend), else ``"buffered"``."""
        files = list(self._files.values())
        if not files or not all(f.direct for f in files):
            return IO_MODE_BUFFERED
        return IO_MODE_URING if self._reader.backend == "io_uring" else IO_MODE_PREAD

    @property
    def blob_bytes(self) -> int:
        return self._manifest.blob_bytes

    @property
    def chunk_bytes(self) -> int:
        """The bytes a read issues at once, the pre-emption granularity (a demand waits behind at
        most the other classes' chunks already in flight)."""
        return self._reader.chunk_bytes

    def reader_stats(self) -> dict[str, int]:
        """The native Reader's counters (submitted, completed, failed, cancelled, bytes_read,
        chunks, preemptions, in_flight, queued)."""
        return self._reader.stats()

    def pause(self) -> None:
        """Stop starting new reads (those in flight finish); for draining and for tests."""
        self._reader.pause()

    def resume(self) -> None:
        self._reader.resume()

    def submit(
        self, key: ExpertKey, out: BlobBuffer, priority: Priority = Priority.DEMAND, *, owner: object = None
    ) -> StoreReadHandle:
        """Start reading ``key``'s blob into the first ``blob_bytes`` of ``out`` (a contiguous CPU
        uint8 buffer, ideally 4 KiB-aligned) at ``priority``; ``handle.wait()`` finishes it, or,
        for a read with an ``owner``, ``reap`` does, in whichever thread reaps (``event_fd`` tells
        when), and hands it back with its ``owner``."""
        if self._closed:
            raise ShuttingDown(f"the store reader is closed: cannot read expert {key}")
        rel, offset = self._manifest.blob_location(key)
        nbytes = self._manifest.blob_bytes
        view = as_writable(out)
        if len(view) < nbytes:
            raise ValueError(f"buffer of {len(view)} bytes cannot hold a blob of {nbytes} bytes")
        view = view[:nbytes]
        lf = self._files[key.layer]
        bounce = None
        address = _address(view)
        if lf.direct and address % _ALIGN:
            bounce = aligned_buffer(nbytes)
            address = _address(memoryview(bounce))
        expected = self._manifest.checksums[key.layer][key.expert]
        with self._lock:
            request_id = self._reader.submit(
                lf.file_id,
                offset,
                nbytes,
                address,
                int(priority),
                expected_crc=expected,
                pollable=owner is not None,
            )
            handle = StoreReadHandle(
                self, key, lf, offset, view, bounce, request_id, Priority(priority), owner
            )
            self._outstanding[request_id] = handle
        return handle

    @property
    def event_fd(self) -> int:
        """A descriptor readable while ``reap`` has reads to finish (sleep on it with poll)."""
        return self._reader.event_fd

    def reap(self, max_n: int = 64) -> list[tuple[StoreReadHandle, Exception | None]]:
        """Finish up to ``max_n`` of the reads with an owner that have completed, in completion
        order, without waiting: each handle (``handle.owner``: the read's) with ``None`` (the blob
        is in its buffer, verified) or the error ``wait`` would have raised (``ShortRead``,
        ``ChecksumMismatch``, ``ShuttingDown``)."""
        out: list[tuple[StoreReadHandle, Exception | None]] = []
        for request_id, _tag, error, _nbytes, _elapsed_s in self._reader.poll(max_n, 0.0):
            with self._lock:
                handle = self._outstanding.get(request_id)
            if handle is None:  # cannot happen: every pollable read has its handle until settled
                logger.error("the store reader reaped request %d, which no handle holds", request_id)
                continue
            try:
                handle._settle(error)
            except Exception as exc:  # noqa: BLE001 - the reaper hands each read's error to its owner
                out.append((handle, exc))
            else:
                out.append((handle, None))
        return out

    def read_into(self, key: ExpertKey, out: BlobBuffer, priority: Priority = Priority.DEMAND) -> None:
        """Read ``key``'s blob into the first ``blob_bytes`` of ``out`` and verify its checksum.

        ``out`` should be page-aligned for O_DIRECT (an unaligned one costs a bounce copy).
        Raises ``ShortRead`` or ``ChecksumMismatch`` (both DATA_LOSS); on error ``out`` holds
        garbage.
        """
        self.submit(key, out, priority).wait()

    def _forget(self, request_id: int) -> None:
        with self._lock:
            self._outstanding.pop(request_id, None)

    def _translate(self, key: ExpertKey, lf: _LayerFile, offset: int, exc: ReadError) -> Exception:
        """The daemon's error for a failed native read of ``key`` (at ``offset`` of ``lf``)."""
        nbytes = self._manifest.blob_bytes
        if exc.kind == "checksum":
            self._metrics.checksum_failures.inc()
            expected = self._manifest.checksums[key.layer][key.expert]
            return ChecksumMismatch(
                f"checksum mismatch for expert {key} in {lf.rel} at offset {offset}: "
                f"expected 0x{expected:08x}, got 0x{exc.actual_crc:08x}"
            )
        if exc.kind == "short_read":
            return ShortRead(
                f"{lf.rel} ends at offset {offset + exc.nbytes}: expert {key}'s blob at offset {offset} "
                f"needs {nbytes} bytes (the store file is truncated)"
            )
        if exc.kind == "cancelled":
            return ShuttingDown(f"the store reader closed before expert {key} was read")
        return ShortRead(f"cannot read expert {key} from {lf.rel}: {exc}")

    # -- MemoryTier ---------------------------------------------------------------------
    def contains(self, key: ExpertKey) -> bool:
        return key.layer in self._manifest.layer_files and 0 <= key.expert < self._manifest.num_experts

    def pin(self, key: ExpertKey) -> bool:
        return self.contains(key)

    def unpin(self, key: ExpertKey) -> None:
        pass

    def get(self, key: ExpertKey) -> torch.Tensor:
        """A fresh ``[blob_bytes]`` uint8 tensor holding ``key``'s verified blob; the caller owns it."""
        buf = aligned_buffer(self._manifest.blob_bytes)
        self.read_into(key, buf)
        return torch.frombuffer(buf, dtype=torch.uint8)

    def put(self, key: ExpertKey, data: torch.Tensor) -> bool:
        raise FailedPrecondition(
            "the expert store is read-only: write it with `python -m cache_daemon.convert`"
        )

    def remove(self, key: ExpertKey) -> bool:
        raise FailedPrecondition("the expert store is read-only: blobs cannot be removed")

    def close(self) -> None:
        """Cancel queued reads (their ``wait`` raises ``ShuttingDown``), wait for those in flight,
        close the files. Idempotent."""
        self._closed = True
        self._reader.close()  # no read touches a caller's buffer after this
        files, self._files = self._files, {}
        for lf in files.values():
            self._reader.close_file(lf.file_id)
            if lf.fadvise_fd >= 0:
                os.close(lf.fadvise_fd)
