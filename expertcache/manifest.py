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
from pathlib import Path, PurePosixPath

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
    "read_manifest_text",
    "store_path",
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


# -- reading untrusted JSON: every error names the key path ("tensors[0].parts[1].shape") ------
MAX_MANIFEST_BYTES = 64 << 20
MAX_COUNT = 1 << 20  # layers, experts, tensors, parts, dimensions: far beyond any real model
MAX_DIM = 1 << 40
MAX_BLOB_BYTES = 1 << 40


class _Malformed(ValueError):
    """A manifest value of the wrong type or range; ``key`` is its path in the JSON."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"key {key!r}: {problem}")
        self.key = key


def _get(raw: dict, key: str, path: str):
    if key not in raw:
        raise _Malformed(f"{path}{key}", "is missing")
    return raw[key]


def _int(value, key: str, lo: int = 0, hi: int = MAX_DIM) -> int:
    # bool is an int in Python, and JSON floats (1.0, NaN) are not counts: both are refused.
    if type(value) is not int:
        raise _Malformed(key, f"must be an integer, got {type(value).__name__} {_short(value)}")
    if not lo <= value <= hi:
        raise _Malformed(key, f"= {value} is out of range [{lo}, {hi}]")
    return value


def _str(value, key: str, max_len: int = 4096) -> str:
    if not isinstance(value, str):
        raise _Malformed(key, f"must be a string, got {type(value).__name__} {_short(value)}")
    if len(value) > max_len or "\0" in value:
        raise _Malformed(key, f"must be a string of at most {max_len} characters without NUL")
    return value


def _list(value, key: str, max_len: int = MAX_COUNT) -> list:
    if not isinstance(value, list):
        raise _Malformed(key, f"must be a list, got {type(value).__name__} {_short(value)}")
    if len(value) > max_len:
        raise _Malformed(key, f"has {len(value)} items, at most {max_len}")
    return value


def _dict(value, key: str) -> dict:
    if not isinstance(value, dict):
        raise _Malformed(key, f"must be an object, got {type(value).__name__} {_short(value)}")
    return value


def _bool(value, key: str) -> bool:
    if not isinstance(value, bool):
        raise _Malformed(key, f"must be true or false, got {type(value).__name__} {_short(value)}")
    return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int_key(value: str, key: str) -> int:
    if not value.isdigit() or len(value) > 9:
        raise _Malformed(key, f"has a non-numeric layer key {_short(value)}")
    return int(value)


def _store_path(value, key: str) -> str:
    """A path inside the store: relative, no '..', no empty or odd components."""
    text = _str(value, key)
    parts = text.split("/")
    if not text or text.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in text:
        raise _Malformed(key, f"= {_short(text)} is not a relative path inside the store")
    return text


def _shape(value, key: str) -> tuple[int, ...]:
    return tuple(_int(d, f"{key}[{i}]", 0, MAX_DIM) for i, d in enumerate(_list(value, key, 16)))


def _tensor_from_json(raw, key: str) -> ExpertTensor:
    raw = _dict(raw, key)
    p = key + "."
    parts_raw = _list(_get(raw, "parts", p), p + "parts", 64)
    parts = []
    for i, part in enumerate(parts_raw):
        pk = f"{p}parts[{i}]"
        part = _dict(part, pk)
        parts.append(
            TensorLayout(
                name=_str(_get(part, "name", pk + "."), pk + ".name", 256),
                dtype=_str(_get(part, "dtype", pk + "."), pk + ".dtype", 64),
                shape=_shape(_get(part, "shape", pk + "."), pk + ".shape"),
                offset=_int(_get(part, "offset", pk + "."), pk + ".offset", 0, MAX_BLOB_BYTES),
            )
        )
    return ExpertTensor(
        name=_str(_get(raw, "name", p), p + "name", 256),
        dtype=_str(_get(raw, "dtype", p), p + "dtype", 64),
        shape=_shape(_get(raw, "shape", p), p + "shape"),
        encoding=_str(_get(raw, "encoding", p), p + "encoding", 64),
        block_size=_shape(_get(raw, "block_size", p), p + "block_size"),
        scale_layout=_str(_get(raw, "scale_layout", p), p + "scale_layout", 64),
        transposed=_bool(_get(raw, "transposed", p), p + "transposed"),
        parts=tuple(parts),
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
    def checkpoint_name(self) -> str:
        """The name of the checkpoint this store was converted from (``source.path``): its
        directory's (``/models/Mixtral-8x7B-v0.1`` → ``Mixtral-8x7B-v0.1``), or for a Hugging
        Face cache snapshot (``.../models--mistralai--Mixtral-8x7B-v0.1/snapshots/<revision>``)
        its repository's, ``mistralai/Mixtral-8x7B-v0.1``; "" when the path is not recorded."""
        parts = PurePosixPath(self.source.get("path", "")).parts
        if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
            return parts[-3].removeprefix("models--").replace("--", "/")
        return parts[-1] if parts and parts[-1] != "/" else ""

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
    def from_json(cls, text: str | bytes, origin: str = "manifest") -> StoreManifest:
        """Parse and validate; any malformed input raises ``DataLoss`` naming ``origin`` and the key."""
        if isinstance(text, bytes | bytearray):
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataLoss(
                    f"{origin} is not UTF-8 text (byte {exc.start}): not a manifest, or a corrupted one"
                ) from None
        try:
            raw = json.loads(text, parse_constant=_refuse_constant)
        except _Malformed as exc:
            raise DataLoss(f"{origin}: {exc}") from None
        except ValueError as exc:  # JSONDecodeError, or an integer of thousands of digits
            raise DataLoss(f"{origin} is not valid JSON: {exc}") from None
        except RecursionError:
            raise DataLoss(f"{origin} is not a manifest: its JSON nests too deeply") from None
        try:
            manifest = cls._from_raw(raw)
        except _Malformed as exc:
            raise DataLoss(f"{origin}: {exc}") from None
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # a check below missed a case
            raise DataLoss(f"{origin} is missing or has a malformed field: {exc!r}") from exc
        manifest.validate(origin)
        return manifest

    @classmethod
    def _from_raw(cls, raw) -> StoreManifest:
        raw = _dict(raw, "(top level)")
        version = _int(_get(raw, "format_version", ""), "format_version", 0, 1 << 20)
        if version != FORMAT_VERSION:
            raise _Malformed(
                "format_version",
                f"is {version}; this ExpertCache reads version {FORMAT_VERSION}: convert the checkpoint again",
            )
        num_layers = _int(_get(raw, "num_layers", ""), "num_layers", 1, MAX_COUNT)
        moe_layers = tuple(
            _int(x, f"moe_layers[{i}]", 0, num_layers - 1)
            for i, x in enumerate(_list(_get(raw, "moe_layers", ""), "moe_layers"))
        )
        if not moe_layers:
            raise _Malformed("moe_layers", "is empty: a store holds at least one MoE layer")
        if len(set(moe_layers)) != len(moe_layers):
            raise _Malformed("moe_layers", "names a layer twice")
        num_experts = _int(_get(raw, "num_experts", ""), "num_experts", 1, MAX_COUNT)
        top_k = _int(_get(raw, "top_k", ""), "top_k", 1, num_experts)
        layer_files = {
            _int_key(k, f"layer_files.{_short(k)}"): _store_path(v, f"layer_files.{k}")
            for k, v in _dict(_get(raw, "layer_files", ""), "layer_files").items()
        }
        checksums = {
            _int_key(k, f"checksums.{_short(k)}"): tuple(
                _int(c, f"checksums.{k}[{i}]", 0, 0xFFFFFFFF)
                for i, c in enumerate(_list(v, f"checksums.{k}", num_experts))
            )
            for k, v in _dict(_get(raw, "checksums", ""), "checksums").items()
        }
        source = _dict(raw.get("source", {}), "source")
        return cls(
            format_version=version,
            model_type=_str(_get(raw, "model_type", ""), "model_type", 256),
            model_id=_str(_get(raw, "model_id", ""), "model_id", 256),
            num_layers=num_layers,
            moe_layers=moe_layers,
            num_experts=num_experts,
            top_k=top_k,
            blob_bytes=_int(_get(raw, "blob_bytes", ""), "blob_bytes", 1, MAX_BLOB_BYTES),
            tensors=tuple(
                _tensor_from_json(t, f"tensors[{i}]")
                for i, t in enumerate(_list(_get(raw, "tensors", ""), "tensors", 64))
            ),
            layer_files=layer_files,
            checksums=checksums,
            dense_file=_store_path(_get(raw, "dense_file", ""), "dense_file"),
            dense_dtype=_str(_get(raw, "dense_dtype", ""), "dense_dtype", 64),
            dense_bytes=_int(raw.get("dense_bytes", 0), "dense_bytes", 0, 1 << 50),
            source={_str(k, "source"): _str(v, f"source.{k}") for k, v in source.items()},
        )

    def validate(self, origin: str = "manifest") -> None:
        if self.blob_bytes <= 0 or self.blob_bytes % BLOB_ALIGN:
            raise DataLoss(
                f"{origin}: blob_bytes {self.blob_bytes} is not a positive multiple of {BLOB_ALIGN}"
            )
        for key, table in (("layer_files", self.layer_files), ("checksums", self.checksums)):
            if set(table) != set(self.moe_layers):
                raise DataLoss(
                    f"{origin}: key {key!r} names layers {sorted(table)}, not the moe_layers "
                    f"{list(self.moe_layers)}"
                )
        for layer, sums in self.checksums.items():
            if len(sums) != self.num_experts:
                raise DataLoss(
                    f"{origin}: layer {layer} has {len(sums)} checksums, expected {self.num_experts}"
                )
        if not self.tensors:
            raise DataLoss(f"{origin}: key 'tensors' is empty: an expert has at least one tensor")
        names = [p.name for p in self.parts]
        if len(set(names)) != len(names) or len({t.name for t in self.tensors}) != len(self.tensors):
            raise DataLoss(f"{origin}: tensor or part names repeat: {names}")
        for t in self.tensors:
            try:
                check_tensor(t)
            except (ValueError, KeyError, TypeError, ZeroDivisionError, OverflowError) as exc:
                raise DataLoss(f"{origin}: {exc}") from exc
            for p in t.parts:
                if p.offset % TENSOR_ALIGN or p.offset < 0 or p.offset + p.nbytes > self.blob_bytes:
                    raise DataLoss(f"{origin}: stored part {p.name!r} lies outside its blob or is misaligned")
        placed = sorted(self.parts, key=lambda p: p.offset)
        for a, b in zip(placed, placed[1:], strict=False):
            if a.offset + a.nbytes > b.offset:
                raise DataLoss(f"{origin}: stored parts {a.name!r} and {b.name!r} overlap")


def _refuse_constant(name: str):
    raise _Malformed("(value)", f"{name} is not valid in a manifest")


def store_path(store_dir: str | Path, rel: str, what: str) -> Path:
    """``STORE/rel`` with its symlinks resolved; ``DataLoss`` naming ``what`` when it leaves the store.

    The manifest's paths are checked as text (relative, no '..'), but a symlink inside the store
    can still point anywhere (``layer_0001.bin -> /etc/shadow``): every file read from a store is
    opened through this, at the path it resolves to."""
    try:
        root = Path(store_dir).resolve()
        target = (root / rel).resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
        raise DataLoss(f"{what} {rel!r} of store {store_dir} cannot be resolved: {exc}") from None
    if not target.is_relative_to(root):
        raise DataLoss(
            f"{what} {rel!r} of store {store_dir} resolves to {target}, outside the store (a symlink "
            "leads out of it): store files must lie inside the store directory"
        )
    return target


def read_manifest(store_dir: str | Path) -> StoreManifest:
    """Read ``STORE/manifest.json``; a missing one means the store is absent or incomplete.

    Whatever the file holds (binary, truncated, wrong types, paths leaving the store), the error
    is a ``DataLoss`` naming the file and the key."""
    return read_manifest_text(store_dir)[0]


def read_manifest_text(store_dir: str | Path) -> tuple[StoreManifest, str]:
    """``read_manifest`` and the file's text as read (the daemon hands it to compute verbatim)."""
    path = Path(store_dir) / MANIFEST_NAME
    resolved = store_path(store_dir, MANIFEST_NAME, "the manifest")
    if not resolved.is_file():
        raise DataLoss(
            f"{path} does not exist: {store_dir} is not a complete expert store "
            "(run `python -m cache_daemon.convert CHECKPOINT STORE` first)"
        )
    try:
        with open(resolved, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise DataLoss(f"cannot read {path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_MANIFEST_BYTES:
        raise DataLoss(f"{path} is over {MAX_MANIFEST_BYTES} bytes: not a manifest")
    return StoreManifest.from_json(data, origin=str(path)), data.decode("utf-8")
