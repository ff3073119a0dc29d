"""The expert store's manifest: what a store directory holds and where each blob lies.

Store directory layout (written by ``python -m cache_daemon.convert``)::

    STORE/
      manifest.json            written last: its presence means the store is complete
      config.json              the runtime model's config (+ generation_config.json, tokenizer files)
      dense.safetensors        every non-expert weight, keyed by the runtime module names
      experts/layer_0001.bin   one file per MoE layer: expert e's blob at e * blob_bytes

Every blob has the same layout (``tensors``): one ``ExpertTensor`` per parameter of the experts
module, ``experts_module.<name>[e]``, with its encoding (``expertcache.encodings``: plain,
mxfp4 or fp8, block size, scale layout) and its stored parts. Part ``p`` of expert ``e`` of
layer ``l`` is the ``p.nbytes`` bytes at ``e * blob_bytes + p.offset`` of ``layer_files[l]``,
``p.shape`` elements of ``p.dtype`` in row-major order; decoding the parts gives the runtime
tensor. Example (GPT-OSS MXFP4, H = 64, I = 64)::

    {"name": "gate_up_proj", "dtype": "bfloat16", "shape": [64, 128], "encoding": "mxfp4",
     "block_size": [1, 32], "scale_layout": "ue8m0", "transposed": true,
     "parts": [{"name": "gate_up_proj_blocks", "dtype": "uint8", "shape": [128, 2, 16], "offset": 0},
               {"name": "gate_up_proj_scales", "dtype": "uint8", "shape": [128, 2], "offset": 4096}]}

``checksums[l][e]`` is the CRC-32 of the blob's full ``blob_bytes`` (padding included,
zero-filled). ``blob_bytes`` counts encoded bytes: it is the slot size of every tier.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from expertcache.encodings import DTYPE_ITEMSIZE, ExpertTensor, TensorLayout, check_tensor, get_encoding
from expertcache.errors import DataLoss, InvalidArgument
from expertcache.keys import ExpertKey

FORMAT_VERSION = 2  # 2: per-tensor encodings with stored parts (1: plain tensors only)
MANIFEST_NAME = "manifest.json"
DENSE_NAME = "dense.safetensors"
BLOB_ALIGN = 4096  # O_DIRECT needs offsets and sizes aligned to the logical block size
TENSOR_ALIGN = 256  # start of each stored part inside a blob: safe for vectorised and CUDA loads

__all__ = [
    "BLOB_ALIGN",
    "DENSE_NAME",
    "DTYPE_ITEMSIZE",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "TENSOR_ALIGN",
    "ExpertTensor",
    "StoreManifest",
    "TensorLayout",
    "align_up",
    "plan_blob",
    "read_manifest",
]


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def plan_blob(
    tensors: list[ExpertTensor | tuple[str, str, tuple[int, ...]]],
) -> tuple[tuple[ExpertTensor, ...], int]:
    """Place every stored part of ``tensors`` in one blob; returns the placed tensors and blob bytes.

    A ``(name, dtype, shape)`` tuple stands for a plain tensor.
    """
    placed = []
    offset = 0
    for tensor in tensors:
        if not isinstance(tensor, ExpertTensor):
            name, dtype, shape = tensor
            if dtype not in DTYPE_ITEMSIZE:
                raise InvalidArgument(f"tensor {name!r} has unsupported dtype {dtype!r}")
            tensor = get_encoding("plain").plan(name, dtype, tuple(shape))
        parts = []
        for part in tensor.parts:
            if part.dtype not in DTYPE_ITEMSIZE:
                raise InvalidArgument(f"tensor {part.name!r} has unsupported dtype {part.dtype!r}")
            offset = align_up(offset, TENSOR_ALIGN)
            parts.append(replace(part, shape=tuple(int(s) for s in part.shape), offset=offset))
            offset += part.nbytes
        placed.append(replace(tensor, shape=tuple(int(s) for s in tensor.shape), parts=tuple(parts)))
    return tuple(placed), align_up(max(offset, 1), BLOB_ALIGN)


def _tensor_json(t: ExpertTensor) -> dict:
    return {
        "name": t.name,
        "dtype": t.dtype,
        "shape": list(t.shape),
        "encoding": t.encoding,
        "block_size": list(t.block_size),
        "scale_layout": t.scale_layout,
        "transposed": t.transposed,
        "parts": [
            {"name": p.name, "dtype": p.dtype, "shape": list(p.shape), "offset": p.offset} for p in t.parts
        ],
    }


def _tensor_from_json(raw: dict) -> ExpertTensor:
    return ExpertTensor(
        name=str(raw["name"]),
        dtype=str(raw["dtype"]),
        shape=tuple(int(s) for s in raw["shape"]),
        encoding=str(raw["encoding"]),
        block_size=tuple(int(b) for b in raw["block_size"]),
        scale_layout=str(raw["scale_layout"]),
        transposed=bool(raw["transposed"]),
        parts=tuple(
            TensorLayout(
                name=str(p["name"]),
                dtype=str(p["dtype"]),
                shape=tuple(int(s) for s in p["shape"]),
                offset=int(p["offset"]),
            )
            for p in raw["parts"]
        ),
    )


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
    tensors: tuple[ExpertTensor, ...]  # one per experts-module parameter, with its stored parts
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
        """Bytes of every blob (encoded, padding included): what the tiers hold and move."""
        return self.num_blobs * self.blob_bytes

    @property
    def parts(self) -> tuple[TensorLayout, ...]:
        """Every stored array of a blob, in blob order."""
        return tuple(p for t in self.tensors for p in t.parts)

    @property
    def encodings(self) -> tuple[str, ...]:
        """Distinct encodings of the expert tensors, e.g. ("mxfp4", "plain")."""
        return tuple(sorted({t.encoding for t in self.tensors}))

    @property
    def decoded_blob_bytes(self) -> int:
        """Bytes of one expert's tensors once decoded into the compute dtype."""
        return sum(t.decoded_nbytes for t in self.tensors)

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
                "tensors": [_tensor_json(t) for t in self.tensors],
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
                tensors=tuple(_tensor_from_json(t) for t in raw["tensors"]),
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
        names = [p.name for p in self.parts]
        if len(set(names)) != len(names) or len({t.name for t in self.tensors}) != len(self.tensors):
            raise DataLoss(f"{origin}: tensor or part names repeat: {names}")
        for t in self.tensors:
            try:
                check_tensor(t)
            except ValueError as exc:
                raise DataLoss(f"{origin}: {exc}") from exc
            for p in t.parts:
                if p.offset % TENSOR_ALIGN or p.offset < 0 or p.offset + p.nbytes > self.blob_bytes:
                    raise DataLoss(f"{origin}: stored part {p.name!r} lies outside its blob or is misaligned")
        placed = sorted(self.parts, key=lambda p: p.offset)
        for a, b in zip(placed, placed[1:], strict=False):
            if a.offset + a.nbytes > b.offset:
                raise DataLoss(f"{origin}: stored parts {a.name!r} and {b.name!r} overlap")


def read_manifest(store_dir: str | Path) -> StoreManifest:
    """Read ``STORE/manifest.json``; a missing one means the store is absent or incomplete."""
    path = Path(store_dir) / MANIFEST_NAME
    if not path.is_file():
        raise DataLoss(
            f"{path} does not exist: {store_dir} is not a complete expert store "
            "(run `python -m cache_daemon.convert CHECKPOINT STORE` first)"
        )
    return StoreManifest.from_json(path.read_text(), origin=str(path))
