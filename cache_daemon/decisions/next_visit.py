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
MAX_FILE_BYTES = 2 * MAX_WEIGHTS * 4 + (1 << 20)  # the model and its horizon head
MAX_HORIZON_VISITS = 64


def tail_probability(p_next: np.ndarray, within: np.ndarray, visits: int) -> np.ndarray:
    """float32 per-visit chance of use at each visit after the next one, from the chance of use at
    the next visit ``p_next`` and within the next ``visits`` visits ``within`` (the horizon
    head), the later visits taken alike and independent:
    ``1 - within = (1 - p_next) * (1 - tail) ** (visits - 1)``. Example: ``p_next = 0.5``,
    ``within = 0.75`` over 3 visits: ``(1 - tail) ** 2 = 0.5``, ``tail = 0.29``. 0 where the
    head says no more than ``p_next`` (the two are fitted apart and may disagree). The daemon
    runs the native ``NextVisitLogistic.tail``, the same arithmetic."""
    miss = np.maximum(1.0 - p_next.astype(np.float64), 1e-12)
    stay = np.clip((1.0 - within.astype(np.float64)) / miss, 0.0, 1.0)
    return (1.0 - stay ** (1.0 / (visits - 1))).astype(np.float32)


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


def _regression(
    prefix: str, w: np.ndarray, b: np.ndarray, window: int
) -> tuple[np.ndarray, np.ndarray, NextVisitLogistic]:
    """One regression's arrays as the model holds them (weights rounded to bfloat16, bias copied,
    both read-only) and its native evaluator; ``NextVisitModelError`` naming ``prefix`` +
    ``weights`` / ``bias`` for a wrong dtype or a non-finite value."""
    for name, a in ((f"{prefix}weights", w), (f"{prefix}bias", b)):
        if a.dtype != np.float32:
            raise NextVisitModelError(f"{name} must be float32, got {a.dtype}")
        if not np.isfinite(a).all():
            raise NextVisitModelError(f"{name} holds non-finite values")
    w = bfloat16_round(w)
    if not np.isfinite(w).all():
        raise NextVisitModelError(f"{prefix}weights overflow bfloat16")
    b = b.copy()
    w.flags.writeable = False
    b.flags.writeable = False
    return w, b, NextVisitLogistic(w, b, window)


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
    horizon_weights: np.ndarray | None = None
    horizon_bias: np.ndarray | None = None
    horizon_visits: int = 0

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
        w, b, native = _regression("", w, b, self.window)
        object.__setattr__(self, "weights", w)
        object.__setattr__(self, "bias", b)
        object.__setattr__(self, "_native", native)
        self._check_horizon()

    def _check_horizon(self) -> None:
        """Validates the optional horizon head (``horizon_weights``, ``horizon_bias``,
        ``horizon_visits``: all three or none) and builds its native evaluator."""
        hw, hb, h = self.horizon_weights, self.horizon_bias, self.horizon_visits
        if hw is None and hb is None and h == 0:
            object.__setattr__(self, "_native_horizon", None)
            return
        if hw is None or hb is None:
            raise NextVisitModelError("horizon head: horizon_weights and horizon_bias come together")
        if not isinstance(h, int) or not 2 <= h <= MAX_HORIZON_VISITS:
            raise NextVisitModelError(
                f"horizon_visits must be an integer in [2, {MAX_HORIZON_VISITS}], got {h!r}"
            )
        if hw.shape != self.weights.shape or hb.shape != self.bias.shape:
            raise NextVisitModelError(
                f"horizon head {hw.shape} / {hb.shape} does not match the model's {self.weights.shape} / "
                f"{self.bias.shape}"
            )
        hw, hb, native = _regression("horizon_", hw, hb, self.window)
        object.__setattr__(self, "horizon_weights", hw)
        object.__setattr__(self, "horizon_bias", hb)
        object.__setattr__(self, "_native_horizon", native)

    @property
    def has_horizon(self) -> bool:
        """Whether the model has the horizon head (the chance of use within ``horizon_visits``
        visits), from which ``step`` derives the per-visit chance beyond the next visit."""
        return self._native_horizon is not None

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
        tail: np.ndarray | None = None,
    ) -> None:
        """MoE layer ``layer`` routed ``experts`` (int64): records them in ``latest`` (float32
        [M * E], the request's one-hot latest routing of every layer), then writes the
        probabilities of the layer's experts at its next visit into ``out`` (float32 [E]) from
        ``latest``'s window and the request's histories of the layer ``short``, ``long`` (float32
        [E]); all contiguous. The daemon's hot path: the native ``NextVisitLogistic`` sums only the
        routed rows (about 2 µs a call for gpt-oss-20b). With the horizon head and ``tail``
        (float32 [E]), also writes there each expert's per-visit chance of use at the visits
        after the next one (``tail_probability``)."""
        self._native.step(layer, experts, latest, short, long, out)
        if tail is not None and self._native_horizon is not None:
            self._native_horizon.tail(layer, latest, short, long, out, self.horizon_visits, tail)

    def predict_within(self, layer: int, x: np.ndarray) -> np.ndarray:
        """float32 [..., E] the horizon head's chance of use within ``horizon_visits`` visits,
        from features ``x`` (as ``predict``); ``NextVisitModelError`` without the head."""
        if self.horizon_weights is None or self.horizon_bias is None:
            raise NextVisitModelError("this next-visit model has no horizon head")
        z = x @ self.horizon_weights[layer] + self.horizon_bias[layer]
        with np.errstate(over="ignore"):  # exp(-z) of a very negative z: inf, and the chance 0
            return (1.0 / (1.0 + np.exp(-z))).astype(np.float32)

    def predict(self, layer: int, x: np.ndarray) -> np.ndarray:
        """float32 [..., E] next-visit probabilities from features ``x`` (float32 [..., w * E + 2E])."""
        z = x @ self.weights[layer] + self.bias[layer]
        return (1.0 / (1.0 + np.exp(-z))).astype(np.float32)

    # -- bytes -------------------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        tensors = {"weights": np.ascontiguousarray(self.weights), "bias": np.ascontiguousarray(self.bias)}
        metadata = {
            "format": FORMAT,
            "window": str(self.window),
            "short_half_life_tokens": repr(float(self.short_half_life_tokens)),
            "long_half_life_tokens": repr(float(self.long_half_life_tokens)),
            "history_start": repr(float(self.history_start)),
            "trained_on": self.trained_on,
        }
        if self.horizon_weights is not None and self.horizon_bias is not None:
            tensors["horizon_weights"] = np.ascontiguousarray(self.horizon_weights)
            tensors["horizon_bias"] = np.ascontiguousarray(self.horizon_bias)
            metadata["horizon_visits"] = str(self.horizon_visits)
        return st_save(tensors, metadata=metadata)

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
        head = [k for k in ("horizon_weights", "horizon_bias") if k in tensors]
        if head and len(head) != 2:
            raise NextVisitModelError("horizon head: horizon_weights and horizon_bias come together")
        horizon_visits = 0
        if head:
            text = meta.get("horizon_visits")
            if text is None or not text.isdigit():
                raise NextVisitModelError(
                    f"metadata horizon_visits must be an integer beside the horizon head, got {text!r}"
                )
            horizon_visits = int(text)
        return cls(
            weights=tensors["weights"],
            bias=tensors["bias"],
            window=int(numbers["window"]),
            short_half_life_tokens=numbers["short_half_life_tokens"],
            long_half_life_tokens=numbers["long_half_life_tokens"],
            history_start=numbers["history_start"],
            trained_on=meta.get("trained_on", ""),
            horizon_weights=tensors.get("horizon_weights"),
            horizon_bias=tensors.get("horizon_bias"),
            horizon_visits=horizon_visits,
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
    "tail_probability",
    "window_start",
]
