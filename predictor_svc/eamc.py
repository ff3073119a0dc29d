"""The EAM collection (EAMC): an in-memory similarity index of one model's finished EAMs
(``EamcIndex``), kept in sync with a store (``Eamc``).

Rows are L2-normalised per layer block, so that a query over the layers seen so far is one matrix
product; a match scans a 4-bit copy of the rows first and rescores its candidates exactly (in the
native core where it has ``eamc_match``). Why and how: docs/predictor.md.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import numpy as np
import torch

from predictor_svc.eam import HEADER_BYTES, EamShape, decode_eam, encode_eam
from predictor_svc.errors import Conflict, CorruptEntry, StoreUnavailable
from predictor_svc.store.base import EamcStore

try:  # the native core's match; an install without it (or an older build) uses numpy
    from expertcache._native import eamc_match as _NATIVE_MATCH
except ImportError:  # pragma: no cover - an install without its build, or a build without the match
    _NATIVE_MATCH = None

logger = logging.getLogger(__name__)

# A full reload fetches and decodes the entries in batches of about this many blob bytes, into
# the index in place: the load peaks at the index plus one batch (its blobs, their EAMs and
# their normalised rows), never at a second copy of the collection.
LOAD_BATCH_BYTES = 8 << 20

# Entries rescored exactly per query: CANDIDATE_FACTOR * top_n, at least MIN_CANDIDATES. By
# bench.predict_bench at 10 K entries, top_n 16: 4x chose the exact top-16 in 100% of queries,
# 3x in 99.7% (in the rest one entry is swapped for another whose exact cosine is within 0.002,
# at cosines around 0.36), 2x in 94.7%; each candidate costs a float32 row read from memory
# (~0.5 us).
CANDIDATE_FACTOR = 3
MIN_CANDIDATES = 32
QUERY_CHUNK = 32  # queries of a batch rescored together (bounds the gathered rows' memory)
# The first-stage scans an index can use (docs/predictor.md), and the default one.
SCANS = ("native", "numpy", "exact")
DEFAULT_SCAN = "native" if _NATIVE_MATCH is not None else "numpy"


Q4_GROUP = 64  # values per 32-byte group of the 4-bit layout (pack_q4)


def q4_row_bytes(width: int) -> int:
    """Bytes of a 4-bit row of ``width`` values: whole 32-byte groups."""
    return -(-width // Q4_GROUP) * (Q4_GROUP // 2)


def pack_q4(values: np.ndarray) -> np.ndarray:
    """uint8 [B, W] with values in [0, 15] -> the 4-bit layout uint8 [B, q4_row_bytes(W)]: byte i
    of group g holds value 64g + i in its low nibble and 64g + 32 + i in its high one."""
    b, w = values.shape
    groups = -(-w // Q4_GROUP)
    padded = np.zeros((b, groups * Q4_GROUP), np.uint8)
    padded[:, :w] = values
    runs = padded.reshape(b, groups, 2, Q4_GROUP // 2)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(b, groups * (Q4_GROUP // 2))


def unpack_q4(packed: np.ndarray, width: int) -> np.ndarray:
    """The first ``width`` values of each 4-bit row: uint8 [N, bytes] -> int8 [N, width]."""
    n = packed.shape[0]
    groups = -(-width // Q4_GROUP)
    runs = packed[:, : groups * (Q4_GROUP // 2)].reshape(n, groups, 1, Q4_GROUP // 2)
    values = np.concatenate([runs & 0x0F, runs >> 4], axis=2).reshape(n, groups * Q4_GROUP)
    return values[:, :width].view(np.int8)


def block_normalise(eams: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer L2 normalisation. ``eams`` [..., L, E] (any numeric) ->
    (normalised float32 [..., L, E], per-layer norms float32 [..., L]); empty layers stay 0."""
    x = np.asarray(eams, dtype=np.float32)
    norms = np.sqrt(np.einsum("...le,...le->...l", x, x, dtype=np.float32))
    safe = np.where(norms > 0, norms, 1.0).astype(np.float32)
    return x / safe[..., None], norms


class EamcIndex:
    """Pre-normalised rows of one model's EAMC entries, for matching. Not thread-safe (Eamc locks)."""

    def __init__(self, shape: EamShape, initial_rows: int = 64, scan: str = DEFAULT_SCAN) -> None:
        self.shape = shape
        self.scan = scan
        width = shape.layers * shape.experts
        self._rows = np.zeros((max(1, initial_rows), width), dtype=np.float32)  # [cap, L*E]
        # The same rows in 4 bits, each scaled by 15 / its largest value (q4 * qscale ~ row), in
        # the packed layout (pack_q4): what predict scans first.
        self._q4 = np.zeros((self._rows.shape[0], q4_row_bytes(width)), dtype=np.uint8)  # [cap, bytes]
        self._qscale = np.zeros(self._rows.shape[0], dtype=np.float32)  # [cap]
        # rank[l, n] = qscale[n] / sqrt(nonempty[n, l]): a 4-bit dot over l layers times this is
        # the entry's cosine up to the query's own (constant) factor, all the ranking needs.
        # Layer-major, so that the first stage reads one contiguous [N] column per query: a
        # strided column (one cache line per entry) cost as much as the first-stage scan itself.
        self._rank = np.zeros((shape.layers + 1, self._rows.shape[0]), dtype=np.float32)
        # scale[n, l] = ||counts of layer l|| / tokens: turns a normalised block into frequencies
        self._scale = np.zeros((self._rows.shape[0], shape.layers), dtype=np.float32)
        # nonempty[n, l] = number of non-empty layer blocks among the first l (l = 0..L)
        self._nonempty = np.zeros((self._rows.shape[0], shape.layers + 1), dtype=np.float32)
        # tokens[n]: the entry's token count, so that its EAM can be rebuilt exactly (eams()):
        # what refills a store that lost its entries.
        self._tokens = np.zeros(self._rows.shape[0], dtype=np.int64)
        self._ids: list[str] = []
        self._pos: dict[str, int] = {}
        self._mean: np.ndarray | None = None  # the collection's mean frequencies, until it changes

    @property
    def scan(self) -> str:
        """The first-stage scan of ``predict`` (one of ``SCANS``); settable."""
        return self._scan

    @scan.setter
    def scan(self, name: str) -> None:
        if name not in SCANS:
            raise ValueError(f"unknown EAMC scan {name!r}: use one of {', '.join(SCANS)}")
        if name == "native" and _NATIVE_MATCH is None:
            raise ValueError(
                "EAMC scan 'native': this build of expertcache._native has no eamc_match "
                "(rebuild it with `make install`), use 'numpy'"
            )
        self._scan = name

    def __len__(self) -> int:
        return len(self._ids)

    def ids(self) -> list[str]:
        return list(self._ids)

    def __contains__(self, entry_id: str) -> bool:
        return entry_id in self._pos

    def upsert(self, entry_id: str, eam: np.ndarray, tokens: int | None = None) -> None:
        """Add or replace ``entry_id`` with ``eam`` (uint32 [L, E]); ``tokens`` defaults to the
        largest layer total (every token routes top_k experts per layer)."""
        eam = self._check(eam)
        if tokens is None:
            tokens = int(eam.sum(axis=1).max()) // self.shape.top_k
        row = self._pos.get(entry_id)
        if row is None:
            row = len(self._ids)
            if row == self._rows.shape[0]:
                self._grow()
            self._ids.append(entry_id)
            self._pos[entry_id] = row
        self._write_rows(np.array([row]), eam[None], np.array([tokens]))

    def upsert_many(self, entry_ids: list[str], eams: np.ndarray, tokens: np.ndarray) -> None:
        """``upsert`` of every ``entry_ids[i]`` with ``eams[i]`` (uint32 [B, L, E]) and ``tokens[i]``,
        normalised and quantised together (no Python work per entry beyond its id)."""
        eams = np.asarray(eams)
        if eams.shape[1:] != (self.shape.layers, self.shape.experts) or len(eams) != len(entry_ids):
            raise ValueError(
                f"eams must be [{len(entry_ids)}, {self.shape.layers}, {self.shape.experts}], got {eams.shape}"
            )
        rows = []
        for entry_id in entry_ids:
            row = self._pos.get(entry_id)
            if row is None:
                row = len(self._ids)
                while row >= self._rows.shape[0]:
                    self._grow()
                self._ids.append(entry_id)
                self._pos[entry_id] = row
            rows.append(row)
        self._write_rows(np.asarray(rows, np.int64), eams, np.asarray(tokens))

    def _write_rows(self, rows: np.ndarray, eams: np.ndarray, tokens: np.ndarray) -> None:
        """Normalise ``eams`` [B, L, E] into ``rows`` [B] (float32 and 4-bit copies, scales)."""
        normalised, norms = block_normalise(eams)  # [B, L, E], [B, L]
        flat = normalised.reshape(len(rows), -1)
        self._rows[rows] = flat
        self._scale[rows] = norms / np.maximum(tokens.astype(np.float32), 1.0)[:, None]
        self._tokens[rows] = tokens
        self._nonempty[rows, 0] = 0
        self._nonempty[rows, 1:] = np.cumsum(norms > 0, axis=1)
        top = flat.max(axis=1)  # >= 0: counts are non-negative
        safe = np.where(top > 0, top, 1.0).astype(np.float32)
        self._q4[rows] = pack_q4(np.rint(flat * (15.0 / safe)[:, None]).astype(np.uint8))
        self._qscale[rows] = np.where(top > 0, top / 15.0, 0.0)
        ne = self._nonempty[rows]
        self._rank[:, rows] = np.divide(
            self._qscale[rows][:, None], np.sqrt(ne), out=np.zeros_like(ne), where=ne > 0
        ).T
        self._mean = None

    def eams(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """The EAMs (uint32 [B, L, E], rebuilt from the normalised rows: count = block value x
        the block's norm) and token counts (int64 [B]) of rows ``start:stop``."""
        L, E = self.shape.layers, self.shape.experts
        stop = min(stop, len(self._ids))
        rows = self._rows[start:stop].reshape(-1, L, E)
        norms = self._scale[start:stop] * np.maximum(self._tokens[start:stop], 1).astype(np.float32)[:, None]
        eams = np.rint(rows * norms[:, :, None]).astype(np.uint32)
        return eams, self._tokens[start:stop].copy()

    def rename_rows(self, start: int, new_ids: list[str]) -> None:
        """Rows ``start .. start + len(new_ids) - 1`` get ``new_ids`` (the store renumbered them)."""
        for row, new_id in enumerate(new_ids, start):
            old = self._ids[row]
            if self._pos.get(old) == row:
                del self._pos[old]
            self._ids[row] = new_id
            self._pos[new_id] = row

    def remove(self, entry_id: str) -> bool:
        """Drop ``entry_id``; the last row moves into its place. False if it was not there."""
        row = self._pos.pop(entry_id, None)
        if row is None:
            return False
        last = len(self._ids) - 1
        if row != last:
            moved = self._ids[last]
            for name in self._ARRAYS:
                arr = getattr(self, name)
                arr[row] = arr[last]
            self._rank[:, row] = self._rank[:, last]
            self._ids[row] = moved
            self._pos[moved] = row
        self._ids.pop()
        for name in self._ARRAYS:
            getattr(self, name)[last] = 0
        self._rank[:, last] = 0
        self._mean = None
        return True

    def similarities(self, partial_eam: np.ndarray, layers_seen: int | None = None) -> np.ndarray:
        """Cosine (block-normalised) of the query to every entry over the first ``layers_seen``
        layers. ``partial_eam`` [L, E] or a batch [T, L, E] -> float32 [N] or [T, N], in the
        order of ``ids()``. One matrix product."""
        q = np.asarray(partial_eam)
        single = q.ndim == 2
        q = q[None] if single else q
        layers = self.shape.layers if layers_seen is None else int(layers_seen)
        if not 0 <= layers <= self.shape.layers:
            raise ValueError(f"layers_seen must be in [0, {self.shape.layers}], got {layers}")
        if q.shape[1:] != (self.shape.layers, self.shape.experts):
            raise ValueError(f"query must be [{self.shape.layers}, {self.shape.experts}], got {q.shape[1:]}")
        n = len(self._ids)
        if n == 0 or layers == 0:
            out = np.zeros((q.shape[0], n), dtype=np.float32)
            return out[0] if single else out
        width = layers * self.shape.experts
        qn, qnorms = block_normalise(q[:, :layers])
        q_nonempty = (qnorms > 0).sum(axis=1).astype(np.float32)  # [T]
        rows = self._rows[:n, :width]  # a view: the product reads the prefix columns in place
        if single:  # matrix-vector: BLAS gemv, cheaper than a 1-row gemm
            dots = (rows @ qn.reshape(width))[None, :]  # [1, N]
        else:
            dots = qn.reshape(q.shape[0], width) @ rows.T  # [T, N]
        denom = np.sqrt(q_nonempty[:, None] * self._nonempty[:n, layers][None, :])
        sims = np.divide(dots, denom, out=np.zeros_like(dots), where=denom > 0)
        return sims[0] if single else sims

    def most_similar(self, eam: np.ndarray) -> tuple[str, float] | None:
        """(id, similarity) of the entry most similar to ``eam`` over all layers; None if empty."""
        if not self._ids:
            return None
        sims = self.similarities(eam)
        best = int(np.argmax(sims))
        return self._ids[best], float(sims[best])

    def predict(
        self,
        partial_eam: np.ndarray,
        layers_seen: int | None = None,
        top_n: int = 8,
        sharpness: float = 1.0,
    ) -> np.ndarray:
        """Per (layer, expert) score in [0, 1]: the similarity-weighted mean expert frequency of
        the ``top_n`` best matches over the first ``layers_seen`` layers (weights sim**sharpness,
        negative sims clipped; equal weights when none is positive). With no layer seen, the
        collection's mean frequency. Query [L, E] -> float32 [L, E]; a batch [T, L, E] ->
        [T, L, E]. Zeros if the collection is empty. Matching in two stages (docs/predictor.md)."""
        q = np.asarray(partial_eam)
        single = q.ndim == 2
        q = q[None] if single else q
        t, n = q.shape[0], len(self._ids)
        L, E = self.shape.layers, self.shape.experts
        layers = L if layers_seen is None else int(layers_seen)
        if not 0 <= layers <= L:
            raise ValueError(f"layers_seen must be in [0, {L}], got {layers}")
        if q.shape[1:] != (L, E):
            raise ValueError(f"query must be [{L}, {E}], got {q.shape[1:]}")
        if n == 0:
            out = np.zeros((t, L, E), dtype=np.float32)
            return out[0] if single else out
        if layers == 0:
            out = np.broadcast_to(self._mean_frequencies(), (t, L, E)).copy()
            return out[0] if single else out
        k = min(top_n, n)
        if self._native_applies(n, k):
            return self._native_match(q, layers, k, sharpness)[2][0 if single else slice(None)]
        best, sims, rows = self._match(q, layers, k)  # [T, k] rows, exact cosines, [T, k, L*E]
        weights = np.clip(sims, 0.0, None) ** sharpness
        total = weights.sum(axis=1, keepdims=True)
        # No positive match: fall back to equal weights over the chosen entries.
        weights = np.where(total > 0, weights / np.where(total > 0, total, 1.0), 1.0 / k).astype(np.float32)
        # frequency = normalised block * its scale: the weight and the scale folded first ([T, k, L])
        wscale = weights[:, :, None] * self._scale[best]
        out = np.einsum("tkl,tkle->tle", wscale, rows.reshape(t, k, L, E))
        np.clip(out, 0.0, 1.0, out=out)
        return out[0] if single else out

    def candidates(self, top_n: int) -> int:
        """Entries rescored exactly per query for a ``top_n`` match."""
        return max(MIN_CANDIDATES, CANDIDATE_FACTOR * top_n)

    def best_matches(self, q: np.ndarray, layers: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` most similar entries to each query of ``q`` [T, L, E] over ``layers`` layers:
        (rows int64 [T, k], exact cosines float32 [T, k]), best first is not guaranteed."""
        if self._native_applies(len(self._ids), k):
            best, sims, _prediction = self._native_match(q, layers, k, 1.0)
        else:
            best, sims, _rows = self._match(q, layers, k)
        return best, sims

    def _native_applies(self, n: int, k: int) -> bool:
        """Whether a ``k``-match over ``n`` entries runs natively (below the candidate count the
        exact scan is the cheapest, in numpy)."""
        return self._scan == "native" and n > self.candidates(k)

    def _native_match(
        self, q: np.ndarray, layers: int, k: int, sharpness: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The whole match in ``_native.eamc_match``: (best [T, k], cosines [T, k], prediction
        [T, L, E]), in chunks of QUERY_CHUNK queries. The arrays are read in place."""
        n, (L, E) = len(self._ids), (self.shape.layers, self.shape.experts)
        counts = np.ascontiguousarray(q, dtype=np.float32)
        collection = (
            self._q4[:n],
            self._rank[layers, :n],
            self._rows[:n],
            self._nonempty[:n, layers],  # a strided column, read in place
            self._scale[:n],
        )
        c = self.candidates(k)
        if len(q) <= QUERY_CHUNK:
            return _NATIVE_MATCH(counts, layers, *collection, c, k, float(sharpness))
        best = np.empty((len(q), k), np.int64)
        sims = np.empty((len(q), k), np.float32)
        prediction = np.empty((len(q), L, E), np.float32)
        for lo in range(0, len(q), QUERY_CHUNK):
            hi = min(lo + QUERY_CHUNK, len(q))
            best[lo:hi], sims[lo:hi], prediction[lo:hi] = _NATIVE_MATCH(
                counts[lo:hi], layers, *collection, c, k, float(sharpness)
            )
        return best, sims, prediction

    def _match(self, q: np.ndarray, layers: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``best_matches`` in numpy (the exact scan, or the numpy two-stage match) plus the
        chosen entries' normalised rows (float32 [T, k, L*E]), which the rescoring has gathered
        already."""
        n, E = len(self._ids), self.shape.experts
        width = layers * E
        qn, qnorms = block_normalise(q[:, :layers])
        qflat = qn.reshape(len(q), width)  # [T, width] float32
        q_nonempty = (qnorms > 0).sum(axis=1).astype(np.float32)  # [T]
        c = self.candidates(k)
        if n <= c or self._scan == "exact":  # a small collection: the exact scan is the cheapest
            dots = qflat @ self._rows[:n, :width].T  # [T, N]
            denom = np.sqrt(q_nonempty[:, None] * self._nonempty[:n, layers][None, :])
            sims = np.divide(dots, denom, out=np.zeros_like(dots), where=denom > 0)
            best = np.argsort(-sims, axis=1, kind="stable")[:, :k]
            return best, np.take_along_axis(sims, best, axis=1), self._rows[best]
        best_out = np.empty((len(q), k), np.int64)
        sims_out = np.empty((len(q), k), np.float32)
        rows_out = np.empty((len(q), k, self._rows.shape[1]), np.float32)
        for lo in range(0, len(q), QUERY_CHUNK):
            hi = min(lo + QUERY_CHUNK, len(q))
            qc = qflat[lo:hi]
            top = qc.max(axis=1, keepdims=True)
            q8 = np.rint(qc * (127.0 / np.where(top > 0, top, 1.0))).astype(np.int8)  # [t, width] in [0, 127]
            cand = self._candidates_numpy(q8, n, layers, c)  # [t, C] rows
            rows = self._rows[cand]  # [t, C, L*E]: whole rows, the chosen ones are returned
            exact = np.matmul(rows[:, :, :width], qc[:, :, None])[:, :, 0]  # [t, C] float32
            d = np.sqrt(q_nonempty[lo:hi, None] * self._nonempty[cand, layers])
            exact = np.divide(exact, d, out=np.zeros_like(exact), where=d > 0)
            pick = np.argpartition(-exact, k - 1, axis=1)[:, :k]
            best_out[lo:hi] = np.take_along_axis(cand, pick, axis=1)
            sims_out[lo:hi] = np.take_along_axis(exact, pick, axis=1)
            rows_out[lo:hi] = np.take_along_axis(rows, pick[:, :, None], axis=1)
        return best_out, sims_out, rows_out

    # The first stage in numpy: q8 int8 [t, width] -> the c rows [t, c] int64 with the highest
    # approximate cosine, 4-bit dot * rank[layers] (the rows' own scale over their norm over
    # ``layers``). The native match ranks by the same float32 score.
    def _candidates_numpy(self, q8: np.ndarray, n: int, layers: int, c: int) -> np.ndarray:
        width = layers * self.shape.experts
        rows8 = torch.from_numpy(unpack_q4(self._q4[:n], width))  # [N, width] int8 in [0, 15]
        rank = torch.from_numpy(self._rank[layers, :n])  # [N]
        idots = torch._int_mm(torch.from_numpy(q8), rows8.t())  # [t, N] int32: exact integer dots
        # Approximate cosine up to a positive factor per query: enough to rank the entries.
        return torch.topk(idots * rank, c, dim=1).indices.numpy()  # [t, C]: a partial top-k

    def _mean_frequencies(self) -> np.ndarray:
        """float32 [L, E]: the mean over every entry of its expert frequencies (cached)."""
        if self._mean is None:
            n, L, E = len(self._ids), self.shape.layers, self.shape.experts
            freqs = self._rows[:n].reshape(n, L, E) * self._scale[:n][..., None]
            self._mean = freqs.mean(axis=0).astype(np.float32)
        return self._mean

    def _check(self, eam: np.ndarray) -> np.ndarray:
        eam = np.asarray(eam)
        if eam.shape != (self.shape.layers, self.shape.experts):
            raise ValueError(f"eam must be [{self.shape.layers}, {self.shape.experts}], got {eam.shape}")
        return eam

    # One row each per entry (entry-major); ``_rank`` is the one layer-major array (a column each).
    _ARRAYS = ("_rows", "_q4", "_qscale", "_scale", "_nonempty", "_tokens")

    def _grow(self) -> None:
        cap = self._rows.shape[0] * 2
        for name in self._ARRAYS:
            old = getattr(self, name)
            new = np.zeros((cap, *old.shape[1:]), dtype=old.dtype)
            new[: old.shape[0]] = old
            setattr(self, name, new)
        rank = np.zeros((self._rank.shape[0], cap), dtype=np.float32)
        rank[:, : self._rank.shape[1]] = self._rank
        self._rank = rank


@dataclass
class SyncCounters:
    """What one ``Eamc`` counted of its traffic with the store."""

    full_reloads: int = 0
    incremental_syncs: int = 0
    changes_applied: int = 0
    conflicts: int = 0  # inserts the store refused (the collection had changed): re-synced, retried
    corrupt_entries: int = 0  # entries skipped because their blob did not decode
    store_errors: int = 0
    refills: int = 0  # times this replica put its entries back into a store that lost them


class Eamc:
    """One model's EAM collection: an ``EamcIndex`` kept in sync with an ``EamcStore``.

    Thread-safe. Store errors propagate as StoreUnavailable (callers count and log them); the
    index keeps answering from what it has. ``counters`` says what the syncing did.
    """

    def __init__(
        self,
        store: EamcStore,
        model_id: str,
        shape: EamShape,
        capacity: int,
        max_insert_attempts: int = 32,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.store = store
        self.model_id = model_id
        self.shape = shape
        self.capacity = capacity
        self.max_insert_attempts = max_insert_attempts
        # Sized for the capacity at once (zero pages cost nothing until written): growing by
        # doubling would copy the arrays and could leave them at twice what the budget reserves.
        self.index = EamcIndex(shape, initial_rows=capacity)
        self._cursor: str | None = None  # guarded by _io_lock
        self._io_lock = threading.Lock()  # serialises store I/O (sync / insert) and the cursor
        self._lock = threading.Lock()  # guards the index; never held across store I/O
        self.counters = SyncCounters()

    @property
    def entries(self) -> int:
        return len(self.index)

    def sync(self) -> int:
        """Apply the store's changes since the cursor (full reload only when the cursor is too
        old or absent). Returns the number of changes applied (entries, on a reload)."""
        with self._io_lock:
            return self._sync_locked()

    def _sync_locked(self) -> int:
        # Store I/O runs without the index lock, so queries keep answering while Redis is slow
        # or down (a connect timeout must not stall hint computation).
        try:
            if self._cursor is not None:
                # In batches of about LOAD_BATCH_BYTES of blobs, like a reload: a replica far
                # behind (many inserts elsewhere) never takes the whole backlog in one reply.
                limit = self._batch_entries()
                applied = 0
                while True:
                    delta = self.store.changes(self.model_id, self._cursor, limit)
                    if delta is None:
                        break
                    changes, cursor = delta
                    with self._lock:
                        for change in changes:
                            if change.op == "put":
                                self._upsert_blob(self.index, change.entry_id, change.blob)
                            else:
                                self.index.remove(change.entry_id)
                        self.counters.incremental_syncs += 1
                        self.counters.changes_applied += len(changes)
                    self._cursor = cursor
                    applied += len(changes)
                    if len(changes) < limit:
                        return applied
                logger.info("EAMC %s: cursor %s too old, reloading", self.model_id, self._cursor)
            return self._reload()
        except StoreUnavailable:
            self.counters.store_errors += 1
            raise

    def _batch_entries(self) -> int:
        """Entries of this model in about LOAD_BATCH_BYTES of blobs (at least 1)."""
        return max(1, LOAD_BATCH_BYTES // (HEADER_BYTES + 4 * self.shape.cells))

    def _reload(self, refill: bool = True) -> int:
        """Load the whole collection from the store, streamed: the ids first, then the blobs in
        batches of LOAD_BATCH_BYTES, decoded into the index in place (entries the store no
        longer has are removed first, so the index never holds more than the capacity). A
        store that lost the collection (empty, while this replica was in sync with it and
        holds entries) gets them back instead (``_refill``)."""
        was_synced = self._cursor is not None
        ids, cursor = self.store.entry_ids(self.model_id)
        if refill and not ids and was_synced and len(self.index):
            return self._refill(cursor)
        keep = set(ids)
        with self._lock:
            for stale in [i for i in self.index.ids() if i not in keep]:
                self.index.remove(stale)
        per_batch = self._batch_entries()
        loaded = 0
        for lo in range(0, len(ids), per_batch):
            blobs = self.store.get_many(self.model_id, ids[lo : lo + per_batch])
            batch_ids, eams, tokens = [], [], []
            for entry_id, blob in blobs.items():  # decoding is per blob; normalising is batched
                try:
                    eam, n_tokens = decode_eam(blob or b"", self.shape)
                except CorruptEntry as exc:
                    self.counters.corrupt_entries += 1
                    logger.warning("EAMC %s: skipping entry %s: %s", self.model_id, entry_id, exc)
                    continue
                batch_ids.append(entry_id)
                eams.append(eam)
                tokens.append(n_tokens)
            del blobs
            if batch_ids:
                with self._lock:
                    self.index.upsert_many(batch_ids, np.stack(eams), np.asarray(tokens))
            loaded += len(batch_ids)
        with self._lock:
            self.counters.full_reloads += 1
        self._cursor = cursor
        return loaded

    def _refill(self, cursor: str) -> int:
        """The store lost this collection (a Redis restarted without its data): write back the
        entries this replica holds, in batches, unless another replica is doing so (the store
        refuses a batch once anybody else wrote: then this replica reloads theirs)."""
        with self._lock:
            held = len(self.index)
        logger.warning(
            "EAMC %s: the store lost the collection; putting back the %d entries held in memory",
            self.model_id,
            held,
        )
        per_batch = self._batch_entries()
        written = 0
        for lo in range(0, held, per_batch):
            with self._lock:
                eams, tokens = self.index.eams(lo, lo + per_batch)
            blobs = [encode_eam(eam, int(n)) for eam, n in zip(eams, tokens, strict=True)]
            del eams
            new_cursor = self.store.refill(self.model_id, cursor, blobs, self.capacity)
            if new_cursor is None:
                logger.warning(
                    "EAMC %s: the store refused the refill (another replica refilled it first, or the "
                    "collection was wiped on purpose): reloading",
                    self.model_id,
                )
                return self._reload(refill=False)  # the store's replace ours (renumbered so far)
            first = int(cursor.rpartition(":")[2]) + 1
            last = int(new_cursor.rpartition(":")[2])
            with self._lock:  # rows lo.. are now the store's entries first..last, in order
                self.index.rename_rows(lo, [str(seq) for seq in range(first, last + 1)])
            cursor = new_cursor
            written += last - first + 1
            if last - first + 1 < len(blobs):
                break  # the store is at capacity (a smaller eamc_capacity): the rest is not kept
        with self._lock:
            for entry_id in self.index.ids()[written:]:
                self.index.remove(entry_id)
        self._cursor = cursor
        self.counters.refills += 1
        return written

    def insert(self, eam: np.ndarray, tokens: int) -> str:
        """Insert a finished request's EAM (uint32 [L, E]); at capacity it replaces the most
        similar entry. Retries on Conflict after a sync; raises Conflict when the attempts run
        out and StoreUnavailable when the store cannot be reached."""
        blob = encode_eam(self.index._check(eam), tokens)
        with self._io_lock:
            for _attempt in range(self.max_insert_attempts):
                if self._cursor is None:
                    self._sync_locked()
                victim = None
                with self._lock:
                    if len(self.index) >= self.capacity:
                        best = self.index.most_similar(eam)
                        victim = best[0] if best else None
                try:
                    entry_id = self.store.insert(self.model_id, blob, self.capacity, victim)
                except Conflict:
                    self.counters.conflicts += 1
                    self._sync_locked()
                    continue
                except StoreUnavailable:
                    self.counters.store_errors += 1
                    raise
                # Pull our own change (and any others) through the log, keeping the cursor true.
                try:
                    self._sync_locked()
                except StoreUnavailable:
                    # Written but not read back: apply locally; the next sync re-applies
                    # idempotently.
                    with self._lock:
                        if victim is not None:
                            self.index.remove(victim)
                        self.index.upsert(entry_id, np.asarray(eam), tokens)
                return entry_id
            raise Conflict(
                f"EAMC {self.model_id!r}: insert gave up after {self.max_insert_attempts} "
                "conflicting attempts"
            )

    def similarities(self, partial_eam: np.ndarray, layers_seen: int | None = None) -> np.ndarray:
        with self._lock:
            return self.index.similarities(partial_eam, layers_seen)

    def predict(
        self,
        partial_eam: np.ndarray,
        layers_seen: int | None = None,
        top_n: int = 8,
        sharpness: float = 1.0,
    ) -> np.ndarray:
        with self._lock:
            return self.index.predict(partial_eam, layers_seen, top_n, sharpness)

    def ids(self) -> list[str]:
        with self._lock:
            return self.index.ids()

    def _upsert_blob(self, index: EamcIndex, entry_id: str, blob: bytes | None) -> None:
        try:
            eam, tokens = decode_eam(blob or b"", self.shape)
        except CorruptEntry as exc:
            self.counters.corrupt_entries += 1
            logger.warning("EAMC %s: skipping entry %s: %s", self.model_id, entry_id, exc)
            index.remove(entry_id)
            return
        index.upsert(entry_id, eam, tokens)
