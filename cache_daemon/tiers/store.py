"""The store tier: expert blobs read from the layer files with O_DIRECT, checksum-verified.

Each MoE layer file is opened once. O_DIRECT bypasses the page cache, so a model larger than
RAM does not evict everything else on the node, and a read costs one DMA into our buffer.
O_DIRECT needs the buffer, file offset and length aligned to the device's logical block size:
offsets and lengths are multiples of ``BLOB_ALIGN`` (4 KiB) by the store format, and callers
pass page-aligned buffers (``aligned_buffer``, host slots, arena slots). Where a filesystem
refuses O_DIRECT (tmpfs, some overlay setups: ``EINVAL``), files are read buffered and the
pages dropped with ``posix_fadvise(DONTNEED)`` after each read, which keeps the same effect on
memory at the cost of one more copy; ``io_mode`` reports which is in use.

Reads are blocking; they run on the daemon's I/O threads (``Residency``), never on a thread
that serves RPCs.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from cache_daemon.errors import ChecksumMismatch, ShortRead, StoreIncomplete
from cache_daemon.metrics import DaemonMetrics
from cache_daemon.tiers.base import MemoryTier, Tier
from expertcache.errors import FailedPrecondition
from expertcache.keys import ExpertKey
from expertcache.manifest import StoreManifest

logger = logging.getLogger(__name__)

IO_MODE_DIRECT = "O_DIRECT"
IO_MODE_BUFFERED = "buffered+fadvise"


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A zeroed, page-aligned, writable buffer of ``nbytes`` (anonymous mmap: always page-aligned)."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def as_writable(buf: torch.Tensor | memoryview | mmap.mmap | bytearray) -> memoryview:
    """A flat byte ``memoryview`` over ``buf`` (a contiguous CPU uint8 tensor or a buffer)."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("store reads need a contiguous CPU buffer")
        buf = buf.numpy()
    view = memoryview(buf)
    if view.readonly:
        raise ValueError("store reads need a writable buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


@dataclass
class _LayerFile:
    rel: str  # path relative to the store, for messages
    path: Path
    fd: int
    direct: bool


class StoreReader(MemoryTier):
    """Read-only ``MemoryTier`` over a store directory.

    ``read_into`` fills a caller-owned buffer (the zero-copy path the daemon uses); ``get``
    returns a fresh caller-owned tensor. Every read is checked against the manifest's CRC-32;
    a mismatch raises ``ChecksumMismatch`` (DATA_LOSS) and counts a checksum failure. Store blobs
    are immutable files, so ``pin``/``unpin`` only check presence, and ``put``/``remove`` refuse.
    """

    tier = Tier.STORE

    def __init__(self, store_dir: str | Path, manifest: StoreManifest, metrics: DaemonMetrics) -> None:
        self._store_dir = Path(store_dir)
        self._manifest = manifest
        self._metrics = metrics
        self._lock = threading.Lock()  # guards re-opening a file in buffered mode
        self._files: dict[int, _LayerFile] = {}
        try:
            for layer in manifest.moe_layers:
                self._files[layer] = self._open(layer)
        except BaseException:
            self.close()
            raise
        logger.info("store %s: %d layer files, reads %s", self._store_dir, len(self._files), self.io_mode)

    def _open(self, layer: int) -> _LayerFile:
        rel = self._manifest.layer_files[layer]
        path = self._store_dir / rel
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
        try:
            return _LayerFile(rel, path, os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC), direct=True)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
        return _LayerFile(rel, path, os.open(path, os.O_RDONLY | os.O_CLOEXEC), direct=False)

    @property
    def io_mode(self) -> str:
        """``"O_DIRECT"`` if every layer file is read with O_DIRECT, else ``"buffered+fadvise"``."""
        files = list(self._files.values())
        return IO_MODE_DIRECT if files and all(f.direct for f in files) else IO_MODE_BUFFERED

    @property
    def blob_bytes(self) -> int:
        return self._manifest.blob_bytes

    def _fall_back_to_buffered(self, lf: _LayerFile) -> None:
        with self._lock:
            if not lf.direct:
                return
            fd = os.open(lf.path, os.O_RDONLY | os.O_CLOEXEC)
            old, lf.fd, lf.direct = lf.fd, fd, False
        # ``old`` may still be in use by a concurrent read of another blob; leaking one fd per
        # layer file (once) is cheaper than coordinating that.
        logger.warning("%s refused an O_DIRECT read (EINVAL); reading it buffered (fd %d kept)", lf.path, old)

    def read_into(self, key: ExpertKey, out: torch.Tensor | memoryview | mmap.mmap | bytearray) -> None:
        """Read ``key``'s blob into the first ``blob_bytes`` of ``out`` and verify its checksum.

        ``out`` should be page-aligned for O_DIRECT (an unaligned buffer falls back to buffered
        reads for that file). Raises ``ShortRead`` or ``ChecksumMismatch`` (both DATA_LOSS);
        on error ``out`` holds garbage.
        """
        rel, offset = self._manifest.blob_location(key)
        nbytes = self._manifest.blob_bytes
        view = as_writable(out)
        if len(view) < nbytes:
            raise ValueError(f"buffer of {len(view)} bytes cannot hold a blob of {nbytes} bytes")
        view = view[:nbytes]
        lf = self._files[key.layer]
        start = time.perf_counter()
        done = 0
        while done < nbytes:
            fd, direct = lf.fd, lf.direct
            try:
                got = os.preadv(fd, [view[done:]], offset + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and direct:
                    self._fall_back_to_buffered(lf)
                    continue
                raise ShortRead(
                    f"cannot read expert {key} from {rel} at offset {offset + done}: {exc.strerror}"
                ) from exc
            if got == 0:
                raise ShortRead(
                    f"{rel} ends at offset {offset + done}: expert {key}'s blob at offset {offset} "
                    f"needs {nbytes} bytes (the store file is truncated)"
                )
            done += got
        if not lf.direct:
            os.posix_fadvise(lf.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        got_crc = zlib.crc32(view)  # releases the GIL for large buffers
        self._metrics.store_read_seconds.inc(time.perf_counter() - start)
        self._metrics.store_read_bytes.inc(nbytes)
        expected = self._manifest.checksums[key.layer][key.expert]
        if got_crc != expected:
            self._metrics.checksum_failures.inc()
            raise ChecksumMismatch(
                f"checksum mismatch for expert {key} in {rel} at offset {offset}: "
                f"expected 0x{expected:08x}, got 0x{got_crc:08x}"
            )
        self._metrics.hits.inc(tier=Tier.STORE.value)

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
        files, self._files = self._files, {}
        for lf in files.values():
            try:
                os.close(lf.fd)
            except OSError:
                pass
