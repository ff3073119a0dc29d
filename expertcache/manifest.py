"""The expert store's manifest: what a store directory holds and where each blob lies.

Store directory layout (written by ``python -m cache_daemon.convert``)::

    STORE/
      manifest.json            written last: its presence means the store is complete
      config.json              the checkpoint's config (+ generation_config.json, tokenizer files)
      dense.safetensors        every non-expert weight, keyed by the runtime module names
      experts/layer_0001.bin   one file per MoE layer: expert e's blob at e * blob_bytes

Every blob has the same layout (``tensors``): tensor ``t`` of expert ``e`` of layer ``l`` is
the ``t.nbytes`` bytes at ``e * blob_bytes + t.offset`` of ``layer_files[l]``, holding
``t.shape`` elements of ``t.dtype`` in row-major order, i.e. exactly
``experts_module.<t.name>[e]`` of the transformers model. ``checksums[l][e]`` is the CRC-32 of
the blob's full ``blob_bytes`` (padding included, zero-filled).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from expertcache.errors import DataLoss, InvalidArgument
from expertcache.keys import ExpertKey

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
DENSE_NAME = "dense.safetensors"
BLOB_ALIGN = 4096  # O_DIRECT needs offsets and sizes aligned to the logical block size
TENSOR_ALIGN = 256  # start of each tensor inside a blob: safe for vectorised and CUDA loads

DTYPE_ITEMSIZE = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
}


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class TensorLayout:
    """One tensor inside every blob: ``experts_module.<name>[expert]``."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the blob

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


def plan_blob(tensors: list[tuple[str, str, tuple[int, ...]]]) -> tuple[tuple[TensorLayout, ...], int]:
    """Lay out ``(name, dtype, shape)`` tensors in one blob; returns the layouts and blob bytes."""
    layouts = []
    offset = 0
    for name, dtype, shape in tensors:
        if dtype not in DTYPE_ITEMSIZE:
            raise InvalidArgument(f"tensor {name!r} has unsupported dtype {dtype!r}")
        offset = align_up(offset, TENSOR_ALIGN)
        layout = TensorLayout(name=name, dtype=dtype, shape=tuple(int(s) for s in shape), offset=offset)
        layouts.append(layout)
        offset += layout.nbytes
    return tuple(layouts), align_up(max(offset, 1), BLOB_ALIGN)


@dataclass(frozen=True)
class StoreManifest:
    """Parsed ``manifest.json``. See the module docstring for the on-disk meaning."""

    model_type: str
    model_id: str  # content hash of the source checkpoint: identifies the model across services
    num_layers: int  # decoder layers, dense ones included
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    blob_bytes: int
    tensors: tuple[TensorLayout, ...]
    layer_files: dict[int, str]  # layer -> path relative to the store directory
    checksums: dict[int, tuple[int, ...]]  # layer -> CRC-32 per expert
    dense_file: str = DENSE_NAME
    dense_dtype: str = "float32"
    dense_bytes: int = 0
    source: dict[str, str] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    # -- derived ------------------------------------------------------------------------
    @property
    def num_blobs(self) -> int:
        return len(self.moe_layers) * self.num_experts

    @property
    def total_expert_bytes(self) -> int:
        return self.num_blobs * self.blob_bytes

    def check_key(self, key: ExpertKey) -> None:
        """Raise ``InvalidArgument`` naming the bad value if ``key`` is not in this store."""
        if key.layer not in self.layer_files:
            raise InvalidArgument(
                f"layer {key.layer} is not a MoE layer of this {self.model_type} model "
                f"(MoE layers: {list(self.moe_layers)})"
            )
        if not 0 <= key.expert < self.num_experts:
            raise InvalidArgument(
                f"expert {key.expert} is out of range for layer {key.layer} "
                f"(the model has {self.num_experts} experts per layer)"
            )

    def blob_location(self, key: ExpertKey) -> tuple[str, int]:
        """(relative file, byte offset) of ``key``'s blob."""
        self.check_key(key)
        return self.layer_files[key.layer], key.expert * self.blob_bytes

    def all_keys(self) -> list[ExpertKey]:
        return [ExpertKey(layer, e) for layer in self.moe_layers for e in range(self.num_experts)]

    # -- (de)serialisation ---------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(
            {
                "format_version": self.format_version,
                "model_type": self.model_type,
                "model_id": self.model_id,
                "num_layers": self.num_layers,
                "moe_layers": list(self.moe_layers),
                "num_experts": self.num_experts,
                "top_k": self.top_k,
                "blob_bytes": self.blob_bytes,
                "tensors": [
                    {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "offset": t.offset}
                    for t in self.tensors
                ],
                "layer_files": {str(k): v for k, v in sorted(self.layer_files.items())},
                "checksums": {str(k): list(v) for k, v in sorted(self.checksums.items())},
                "dense_file": self.dense_file,
                "dense_dtype": self.dense_dtype,
                "dense_bytes": self.dense_bytes,
                "source": dict(self.source),
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str, origin: str = "manifest") -> StoreManifest:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataLoss(f"{origin} is not valid JSON: {exc}") from exc
        try:
            version = int(raw["format_version"])
            if version != FORMAT_VERSION:
                raise DataLoss(
                    f"{origin} has format_version {version}; this ExpertCache reads version "
                    f"{FORMAT_VERSION}: convert the checkpoint again"
                )
            manifest = cls(
                format_version=version,
                model_type=str(raw["model_type"]),
                model_id=str(raw["model_id"]),
                num_layers=int(raw["num_layers"]),
                moe_layers=tuple(int(x) for x in raw["moe_layers"]),
                num_experts=int(raw["num_experts"]),
                top_k=int(raw["top_k"]),
                blob_bytes=int(raw["blob_bytes"]),
                tensors=tuple(
                    TensorLayout(
                        name=str(t["name"]),
                        dtype=str(t["dtype"]),
                        shape=tuple(int(s) for s in t["shape"]),
                        offset=int(t["offset"]),
                    )
                    for t in raw["tensors"]
                ),
                layer_files={int(k): str(v) for k, v in raw["layer_files"].items()},
                checksums={int(k): tuple(int(c) for c in v) for k, v in raw["checksums"].items()},
                dense_file=str(raw["dense_file"]),
                dense_dtype=str(raw["dense_dtype"]),
                dense_bytes=int(raw.get("dense_bytes", 0)),
                source={str(k): str(v) for k, v in raw.get("source", {}).items()},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise DataLoss(f"{origin} is missing or has a malformed field: {exc!r}") from exc
        manifest.validate(origin)
        return manifest

    def validate(self, origin: str = "manifest") -> None:
        if self.blob_bytes <= 0 or self.blob_bytes % BLOB_ALIGN:
            raise DataLoss(
                f"{origin}: blob_bytes {self.blob_bytes} is not a positive multiple of {BLOB_ALIGN}"
            )
        if set(self.layer_files) != set(self.moe_layers) or set(self.checksums) != set(self.moe_layers):
            raise DataLoss(f"{origin}: layer_files/checksums do not cover moe_layers {list(self.moe_layers)}")
        for layer, sums in self.checksums.items():
            if len(sums) != self.num_experts:
                raise DataLoss(
                    f"{origin}: layer {layer} has {len(sums)} checksums, expected {self.num_experts}"
                )
        for t in self.tensors:
            if t.dtype not in DTYPE_ITEMSIZE:
                raise DataLoss(f"{origin}: tensor {t.name!r} has unknown dtype {t.dtype!r}")
            if t.offset % TENSOR_ALIGN or t.offset + t.nbytes > self.blob_bytes:
                raise DataLoss(f"{origin}: tensor {t.name!r} lies outside its blob or is misaligned")


def read_manifest(store_dir: str | Path) -> StoreManifest:
    """Read ``STORE/manifest.json``; a missing one means the store is absent or incomplete."""
    path = Path(store_dir) / MANIFEST_NAME
    if not path.is_file():
        raise DataLoss(
            f"{path} does not exist: {store_dir} is not a complete expert store "
            "(run `python -m cache_daemon.convert CHECKPOINT STORE` first)"
        )
    return StoreManifest.from_json(path.read_text(), origin=str(path))
