"""The embedded EAMC store: the ``EamcStore`` semantics in process, for running without Redis.

Thread-safe (one lock). Saved to one file on shutdown, written atomically (tmp file, fsync,
rename), so a crash mid-save leaves the previous file intact. File format (little-endian, raw,
never pickle):

    magic b"EAMCSTO2" | u32 catalog count
    per registered model: u32 len + model_id utf-8 | u32 len + shape utf-8 ("LxExK")
    u32 model count
    per model: u32 len + model_id utf-8 | u32 len + epoch utf-8 | u64 seq | u32 entry count
        per entry: u32 len + entry_id utf-8 | u32 len + blob (the predictor_svc.eam format)
    u32 crc32 of everything before it

A file of the first format (magic b"EAMCSTO1": no catalog section) still loads.

The change log is not saved: a cursor taken before a reload is older than the log and the reader
reloads, exactly as with a trimmed Redis stream.
"""

from __future__ import annotations

import collections
import io
import logging
import os
import struct
import threading
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from predictor_svc.errors import Conflict, CorruptEntry
from predictor_svc.store.base import Change, EamcStore

logger = logging.getLogger(__name__)

FILE_MAGIC = b"EAMCSTO2"
FILE_MAGIC_V1 = b"EAMCSTO1"  # before the model catalog
DEFAULT_LOG_LEN = 4096


@dataclass
class _Collection:
    epoch: str = field(default_factory=lambda: uuid.uuid4().hex)
    seq: int = 0  # seq of the last change-log record
    entries: dict[str, bytes] = field(default_factory=dict)
    log: collections.deque = field(default_factory=collections.deque)  # (seq, Change)


def _parse_cursor(cursor: str) -> tuple[str, int]:
    epoch, _, seq = cursor.partition(":")
    try:
        return epoch, int(seq)
    except ValueError:
        return epoch, -1


class EmbeddedStore(EamcStore):
    """In-process per-model EAM collections; ``path`` (optional) is where ``close()`` saves."""

    def __init__(self, path: Path | None = None, log_len: int = DEFAULT_LOG_LEN) -> None:
        if log_len < 1:
            raise ValueError(f"log_len must be >= 1, got {log_len}")
        self.path = Path(path) if path is not None else None
        self._log_len = log_len
        self._lock = threading.Lock()
        self._models: dict[str, _Collection] = {}
        self._catalog: dict[str, str] = {}  # model id -> "LxExK"
        self._closed = False

    # -- EamcStore ---------------------------------------------------------------------------
    def load(self, model_id: str) -> tuple[dict[str, bytes], str]:
        with self._lock:
            coll = self._coll(model_id)
            return dict(coll.entries), f"{coll.epoch}:{coll.seq}"

    def entry_ids(self, model_id: str) -> tuple[list[str], str]:
        with self._lock:
            coll = self._coll(model_id)
            return list(coll.entries), f"{coll.epoch}:{coll.seq}"

    def get_many(self, model_id: str, entry_ids: list[str]) -> dict[str, bytes]:
        with self._lock:
            entries = self._coll(model_id).entries
            return {i: entries[i] for i in entry_ids if i in entries}

    def refill(self, model_id: str, cursor: str, blobs: list[bytes], capacity: int) -> str | None:
        with self._lock:
            coll = self._coll(model_id)
            if cursor != f"{coll.epoch}:{coll.seq}":
                return None
            for blob in blobs:
                if len(coll.entries) >= capacity:
                    break
                entry_id = str(coll.seq + 1)
                coll.entries[entry_id] = bytes(blob)
                self._append(coll, Change("put", entry_id, bytes(blob)))
            return f"{coll.epoch}:{coll.seq}"

    def changes(self, model_id: str, cursor: str, limit: int = 0) -> tuple[list[Change], str] | None:
        epoch, seq = _parse_cursor(cursor)
        with self._lock:
            coll = self._coll(model_id)
            if epoch != coll.epoch or seq < 0 or seq > coll.seq:
                return None
            if seq == coll.seq:
                return [], cursor
            first_seq = coll.log[0][0] if coll.log else coll.seq + 1
            if seq + 1 < first_seq:
                return None  # the records right after the cursor were trimmed
            out = [(s, change) for s, change in coll.log if s > seq]
            if limit and len(out) > limit:
                out = out[:limit]
            return [change for _s, change in out], f"{coll.epoch}:{out[-1][0]}"

    def insert(self, model_id: str, blob: bytes, capacity: int, victim_id: str | None) -> str:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        blob = bytes(blob)
        with self._lock:
            coll = self._coll(model_id)
            if len(coll.entries) >= capacity:
                if victim_id is None:
                    raise Conflict(
                        f"EAMC {model_id!r} is at capacity {capacity} "
                        f"({len(coll.entries)} entries) and no victim was named"
                    )
                if victim_id not in coll.entries:
                    raise Conflict(f"EAMC {model_id!r}: victim {victim_id!r} is gone")
                del coll.entries[victim_id]
                self._append(coll, Change("del", victim_id, None))
            entry_id = str(coll.seq + 1)
            coll.entries[entry_id] = blob
            self._append(coll, Change("put", entry_id, blob))
            return entry_id

    def models(self) -> dict[str, str]:
        with self._lock:
            return dict(self._catalog)

    def register_model(self, model_id: str, shape: str, max_models: int) -> tuple[str, str]:
        with self._lock:
            current = self._catalog.get(model_id)
            if current is not None:
                return "exists", current
            if len(self._catalog) >= max_models:
                return "full", str(len(self._catalog))
            self._catalog[model_id] = shape
            return "created", shape

    def count(self, model_id: str) -> int:
        with self._lock:
            coll = self._models.get(model_id)
            return len(coll.entries) if coll else 0

    def close(self) -> None:
        """Save to ``path`` (when set); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.path is not None:
            self.save(self.path)

    # -- persistence ---------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Write every collection to ``path`` atomically (tmp + fsync + rename)."""
        path = Path(path)
        buf = io.BytesIO()
        with self._lock:
            buf.write(FILE_MAGIC)
            buf.write(struct.pack("<I", len(self._catalog)))
            for model_id, shape in self._catalog.items():
                _put_str(buf, model_id)
                _put_str(buf, shape)
            buf.write(struct.pack("<I", len(self._models)))
            for model_id, coll in self._models.items():
                _put_str(buf, model_id)
                _put_str(buf, coll.epoch)
                buf.write(struct.pack("<QI", coll.seq, len(coll.entries)))
                for entry_id, blob in coll.entries.items():
                    _put_str(buf, entry_id)
                    _put_bytes(buf, blob)
        data = buf.getvalue()
        data += struct.pack("<I", zlib.crc32(data))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
        logger.info("saved embedded EAMC store to %s (%d bytes)", path, len(data))

    @classmethod
    def load_file(cls, path: Path, log_len: int = DEFAULT_LOG_LEN) -> EmbeddedStore:
        """A store with the collections saved in ``path`` that saves back there on ``close()``.

        A missing file gives an empty store; an unreadable one raises CorruptEntry naming the
        file and the problem.
        """
        path = Path(path)
        store = cls(path, log_len)
        if not path.exists():
            return store
        data = path.read_bytes()
        if len(data) < len(FILE_MAGIC) + 8:
            raise CorruptEntry(f"embedded EAMC file {path} is truncated ({len(data)} bytes)")
        magic = data[: len(FILE_MAGIC)]
        if magic not in (FILE_MAGIC, FILE_MAGIC_V1):
            raise CorruptEntry(
                f"embedded EAMC file {path} has bad magic {data[:8]!r}, expected {FILE_MAGIC!r}"
            )
        (crc,) = struct.unpack_from("<I", data, len(data) - 4)
        if zlib.crc32(data[:-4]) != crc:
            raise CorruptEntry(f"embedded EAMC file {path} checksum mismatch (truncated or corrupt)")
        reader = _Reader(data[:-4], len(FILE_MAGIC), path)
        if magic == FILE_MAGIC:
            for _ in range(reader.u32()):
                model_id = reader.string()
                store._catalog[model_id] = reader.string()
        for _ in range(reader.u32()):
            model_id = reader.string()
            coll = _Collection(epoch=reader.string())
            coll.seq = reader.u64()
            for _ in range(reader.u32()):
                entry_id = reader.string()
                coll.entries[entry_id] = reader.blob()
            store._models[model_id] = coll
        if reader.pos != len(reader.data):
            raise CorruptEntry(f"embedded EAMC file {path} has trailing bytes at {reader.pos}")
        return store

    # -- internals -------------------------------------------------------------------------------
    def _coll(self, model_id: str) -> _Collection:
        coll = self._models.get(model_id)
        if coll is None:
            coll = self._models[model_id] = _Collection()
        return coll

    def _append(self, coll: _Collection, change: Change) -> None:
        coll.seq += 1
        coll.log.append((coll.seq, change))
        while len(coll.log) > self._log_len:
            coll.log.popleft()


def _put_bytes(buf: io.BytesIO, data: bytes) -> None:
    buf.write(struct.pack("<I", len(data)))
    buf.write(data)


def _put_str(buf: io.BytesIO, text: str) -> None:
    _put_bytes(buf, text.encode("utf-8"))


class _Reader:
    def __init__(self, data: bytes, pos: int, path: Path) -> None:
        self.data, self.pos, self.path = data, pos, path

    def _take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise CorruptEntry(
                f"embedded EAMC file {self.path} truncated: needs {n} bytes at offset {self.pos}"
            )
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return struct.unpack("<I", self._take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self._take(8))[0]

    def blob(self) -> bytes:
        return self._take(self.u32())

    def string(self) -> str:
        try:
            return self.blob().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CorruptEntry(f"embedded EAMC file {self.path}: bad utf-8 string: {exc}") from exc
