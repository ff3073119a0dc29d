"""The learned next-visit model (``NextVisitModel``): a layer's experts at its next visit, from every
layer's latest routing; one logistic regression per MoE layer, fitted offline
(``replay.learn_next_visit``) and read here (``read``). Its features, an example and its cost are
in ``docs/daemon.md``. Pure arithmetic: no I/O but the file, no threads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from expertcache.native import NextVisitLogistic

FORMAT = "expertcache-next-visit/1"
# Bounds on what a file may claim, so that a hostile or corrupt one cannot make the daemon
# allocate wildly or run a mat-vec that would dominate every routed layer.
MAX_LAYERS = 1 << 12
MAX_EXPERTS = 1 << 12
MAX_WEIGHTS = 1 << 28  # floats (1 GiB)
MAX_FILE_BYTES = MAX_WEIGHTS * 4 + (1 << 20)


class NextVisitModelError(ValueError):
    """A next-visit model (or its bytes) is malformed or does not fit the model served; the
    message says what is wrong."""


def window_start(layer: int, num_layers: int, window: int) -> int:
    """First MoE layer of the input window of MoE layer ``layer``."""
    return min(max(layer - (window - 1) // 2, 0), num_layers - window)


def bfloat16_round(a: np.ndarray) -> np.ndarray:
    """float32 ``a`` rounded to bfloat16 precision (nearest even), as float32 (a fresh array)."""
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


@dataclass(frozen=True, eq=False)
class NextVisitModel:
    """One logistic model per MoE layer (see the module docstring). Arrays are float32 and
    read-only: ``weights [M, w * E + 2E, E]``, ``bias [M, E]``. The weights are held at bfloat16
    precision (rounded on construction): the hot path reads them as bfloat16, half the bytes,
    and this copy computes the same numbers."""

    weights: np.ndarray
    bias: np.ndarray
    window: int
    short_half_life_tokens: float
    long_half_life_tokens: float
    history_start: float
    trained_on: str = ""

    def __post_init__(self) -> None:
        w, b = self.weights, self.bias
        if w.ndim != 3 or b.ndim != 2:
            raise NextVisitModelError(f"weights must be 3-D and bias 2-D, got shapes {w.shape} and {b.shape}")
        M, F, E = w.shape
        if not (1 <= M <= MAX_LAYERS and 1 <= E <= MAX_EXPERTS and w.size <= MAX_WEIGHTS):
            raise NextVisitModelError(
                f"weights {w.shape} outside the bounds (layers <= {MAX_LAYERS}, experts <= {MAX_EXPERTS}, "
                f"<= {MAX_WEIGHTS} floats)"
            )
        if not 1 <= self.window <= M:
            raise NextVisitModelError(f"window must be in [1, {M}] layers, got {self.window}")
        if F != (self.window + 2) * E:
            raise NextVisitModelError(
                f"weights {w.shape}: {F} inputs per layer, expected (window + 2) * experts = "
                f"{(self.window + 2) * E}"
            )
        if b.shape != (M, E):
            raise NextVisitModelError(f"bias {b.shape} does not match weights {w.shape} (expected {(M, E)})")
        for name in ("short_half_life_tokens", "long_half_life_tokens"):
            v = getattr(self, name)
            if not (0.0 < v < float("inf")):
                raise NextVisitModelError(f"{name} must be > 0 and finite, got {v}")
        if not 0.0 <= self.history_start <= 1.0:
            raise NextVisitModelError(f"history_start must be in [0, 1], got {self.history_start}")
        for name, a in (("weights", w), ("bias", b)):
            if a.dtype != np.float32:
                raise NextVisitModelError(f"{name} must be float32, got {a.dtype}")
            if not np.isfinite(a).all():
                raise NextVisitModelError(f"{name} holds non-finite values")
        w = bfloat16_round(w)
        if not np.isfinite(w).all():
            raise NextVisitModelError("weights overflow bfloat16")
        b = b.copy()
        w.flags.writeable = False
        b.flags.writeable = False
        object.__setattr__(self, "weights", w)
        object.__setattr__(self, "bias", b)
        object.__setattr__(self, "_native", NextVisitLogistic(w, b, self.window))

    @property
    def num_layers(self) -> int:
        """MoE layers (``M``)."""
        return int(self.weights.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.weights.shape[2])

    def window_start(self, layer: int) -> int:
        return window_start(layer, self.num_layers, self.window)

    def decays(self) -> tuple[float, float]:
        """Per-token decays of the short and long histories the model was fitted with."""
        return 0.5 ** (1.0 / self.short_half_life_tokens), 0.5 ** (1.0 / self.long_half_life_tokens)

    def step(
        self,
        layer: int,
        experts: np.ndarray,
        latest: np.ndarray,
        short: np.ndarray,
        long: np.ndarray,
        out: np.ndarray,
    ) -> None:
        """MoE layer ``layer`` routed ``experts`` (int64): records them in ``latest`` (float32
        [M * E], the request's one-hot latest routing of every layer), then writes the
        probabilities of the layer's experts at its next visit into ``out`` (float32 [E]) from
        ``latest``'s window and the request's histories of the layer ``short``, ``long`` (float32
        [E]); all contiguous. The daemon's hot path: the native ``NextVisitLogistic`` sums only the
        routed rows (about 2 µs a call for gpt-oss-20b)."""
        self._native.step(layer, experts, latest, short, long, out)

    def predict(self, layer: int, x: np.ndarray) -> np.ndarray:
        """float32 [..., E] next-visit probabilities from features ``x`` (float32 [..., w * E + 2E])."""
        z = x @ self.weights[layer] + self.bias[layer]
        return (1.0 / (1.0 + np.exp(-z))).astype(np.float32)

    # -- bytes -------------------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        return st_save(
            {"weights": np.ascontiguousarray(self.weights), "bias": np.ascontiguousarray(self.bias)},
            metadata={
                "format": FORMAT,
                "window": str(self.window),
                "short_half_life_tokens": repr(float(self.short_half_life_tokens)),
                "long_half_life_tokens": repr(float(self.long_half_life_tokens)),
                "history_start": repr(float(self.history_start)),
                "trained_on": self.trained_on,
            },
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> NextVisitModel:
        """The model in ``data`` (``to_bytes``'s format); ``NextVisitModelError`` naming what is
        wrong for anything else."""
        try:
            tensors = st_load(data)
        except (SafetensorError, ValueError, OSError) as exc:
            raise NextVisitModelError(f"not a safetensors file: {exc}") from None
        meta = _metadata(data)
        if meta.get("format") != FORMAT:
            raise NextVisitModelError(f"format is {meta.get('format')!r}, expected {FORMAT!r}")
        missing = sorted({"weights", "bias"} - set(tensors))
        if missing:
            raise NextVisitModelError(f"missing tensors {missing}")
        try:
            numbers = {
                k: float(meta[k])
                for k in ("window", "short_half_life_tokens", "long_half_life_tokens", "history_start")
            }
        except KeyError as exc:
            raise NextVisitModelError(f"metadata {exc.args[0]!r} missing") from None
        except ValueError as exc:
            raise NextVisitModelError(f"metadata: {exc}") from None
        if numbers["window"] != int(numbers["window"]):
            raise NextVisitModelError(f"metadata window must be an integer, got {meta['window']!r}")
        return cls(
            weights=tensors["weights"],
            bias=tensors["bias"],
            window=int(numbers["window"]),
            short_half_life_tokens=numbers["short_half_life_tokens"],
            long_half_life_tokens=numbers["long_half_life_tokens"],
            history_start=numbers["history_start"],
            trained_on=meta.get("trained_on", ""),
        )


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes (the numpy loader drops it)."""
    import json

    try:
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
    except (ValueError, UnicodeDecodeError) as exc:
        raise NextVisitModelError(f"unreadable safetensors header: {exc}") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def read(path: str | os.PathLike) -> NextVisitModel:
    """The model in file ``path`` (written by ``replay.learn_next_visit``); ``NextVisitModelError``
    naming the file and what is wrong."""
    try:
        size = os.stat(path).st_size
        if size > MAX_FILE_BYTES:
            raise NextVisitModelError(f"{size} bytes, over the {MAX_FILE_BYTES} a model may have")
        with open(path, "rb") as f:
            data = f.read()
        return NextVisitModel.from_bytes(data)
    except NextVisitModelError as exc:
        raise NextVisitModelError(f"next-visit model {os.fspath(path)}: {exc}") from None
    except OSError as exc:
        raise NextVisitModelError(f"next-visit model {os.fspath(path)}: {exc.strerror or exc}") from None


__all__ = [
    "FORMAT",
    "NextVisitModel",
    "NextVisitModelError",
    "read",
    "window_start",
]
