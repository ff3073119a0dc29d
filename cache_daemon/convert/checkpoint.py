"""The source checkpoint of a conversion: a transformers directory, checked, read tensor by tensor.

``open_checkpoint`` validates the directory and reads only its config and safetensors headers
(which file holds which key); ``TensorReader`` then reads tensors by their *runtime* name (the
``SourceLayout`` maps checkpoint keys), whole or one expert's slice of a stacked tensor, so the
converter holds at most a few experts and one dense tensor in memory.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from cache_daemon.convert.sources import Quantization, SourceLayout, parse_quantization
from expertcache.errors import DataLoss, InvalidArgument, NotFound

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
# Bytes per element of safetensors dtype codes: checkpoint headers and the streamed dense file's.
SAFETENSORS_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory, validated, with every tensor's file (from headers only)."""

    path: Path
    config: Mapping[str, object]  # parsed config.json
    config_bytes: bytes
    index_bytes: bytes  # model.safetensors.index.json, or b"" for an unsharded checkpoint
    files: tuple[str, ...]  # safetensors file names relative to ``path``
    key_files: Mapping[str, str]  # checkpoint key → file name

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    @property
    def declares_dtype(self) -> bool:
        return bool(self.config.get("dtype") or self.config.get("torch_dtype"))

    @property
    def quant_method(self) -> str | None:
        quantization = self.config.get("quantization_config")
        return str(quantization.get("quant_method")) if isinstance(quantization, dict) else None

    def quantization(self) -> Quantization:
        return parse_quantization(self.config)

    def source_id(self) -> str:
        """Content hash identifying the checkpoint: config, index, and each file's name and size."""
        digest = hashlib.sha256()
        for part in (CONFIG_NAME.encode(), self.config_bytes, INDEX_NAME.encode(), self.index_bytes):
            digest.update(len(part).to_bytes(8, "little") + part)
        for name in self.files:
            digest.update(f"{name}\0{(self.path / name).stat().st_size}\0".encode())
        return digest.hexdigest()


def open_checkpoint(src: Path) -> Checkpoint:
    """Validate ``src`` and read its config and safetensors headers (no tensor data)."""
    if not src.is_dir():
        raise NotFound(f"checkpoint directory {src} does not exist (or is not a directory)")
    config_path = src / CONFIG_NAME
    if not config_path.is_file():
        raise NotFound(f"{src} has no {CONFIG_NAME}: not a transformers checkpoint directory")
    config_bytes = config_path.read_bytes()
    try:
        config = json.loads(config_bytes)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{config_path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict) or not config.get("model_type"):
        raise InvalidArgument(f"{config_path} has no model_type")
    index_bytes, files = _safetensors_files(src)
    return Checkpoint(
        path=src,
        config=config,
        config_bytes=config_bytes,
        index_bytes=index_bytes,
        files=files,
        key_files=_key_files(src, files),
    )


def _safetensors_files(src: Path) -> tuple[bytes, tuple[str, ...]]:
    index_path = src / INDEX_NAME
    if index_path.is_file():
        index_bytes = index_path.read_bytes()
        try:
            files = sorted(set(json.loads(index_bytes)["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidArgument(
                f"{index_path} is not a safetensors index (no weight_map): {exc!r}"
            ) from exc
        missing = [name for name in files if not (src / name).is_file()]
        if missing:
            raise NotFound(f"{index_path} names shard(s) that do not exist: {', '.join(missing)}")
        return index_bytes, tuple(files)
    if (src / SINGLE_FILE_NAME).is_file():
        return b"", (SINGLE_FILE_NAME,)
    files = sorted(p.name for p in src.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in src.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        hint = f" (found {', '.join(others)}: re-save it with save_pretrained)" if others else ""
        raise NotFound(f"{src} has no *.safetensors weights{hint}")
    return b"", tuple(files)


def _key_files(src: Path, files: tuple[str, ...]) -> dict[str, str]:
    key_files: dict[str, str] = {}
    for name in files:
        try:
            with safe_open(str(src / name), framework="pt") as handle:
                keys = list(handle.keys())
        except Exception as exc:  # safetensors raises its own error types for a bad header
            raise DataLoss(f"{src / name} is not a readable safetensors file: {exc}") from exc
        for key in keys:
            if key in key_files:
                raise InvalidArgument(f"tensor {key} appears in both {key_files[key]} and {name}")
            key_files[key] = name
    return key_files


class TensorReader:
    """Reads checkpoint tensors by *runtime* name: whole, or one expert's slice [e] of dim 0.

    Files are memory-mapped by safetensors and opened once; nothing is cached, so the memory
    held is the tensor just returned.
    """

    def __init__(self, checkpoint: Checkpoint, layout: SourceLayout) -> None:
        self._checkpoint = checkpoint
        self._names: dict[str, str] = {}  # runtime name → checkpoint key
        for key in checkpoint.key_files:
            name = layout.runtime_name(key)
            if name in self._names:
                raise InvalidArgument(f"checkpoint keys {self._names[name]} and {key} both map to {name}")
            self._names[name] = key
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()
        self._handles.clear()

    @property
    def names(self) -> Mapping[str, str]:
        """Runtime name → checkpoint key, for every tensor of the checkpoint."""
        return self._names

    def _handle(self, name: str):
        file_name = self._checkpoint.key_files[self._names[name]]
        if file_name not in self._handles:
            path = self._checkpoint.path / file_name
            self._handles[file_name] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        return self._handles[file_name]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(self._names[name])

    def get_slice(self, name: str, index: int) -> torch.Tensor:
        return self._handle(name).get_slice(self._names[name])[index]  # reads only row `index`

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(self._names[name]).get_shape())

    def safetensors_dtype(self, name: str) -> str:
        return self._handle(name).get_slice(self._names[name]).get_dtype()  # e.g. "BF16"

    def nbytes(self, name: str) -> int:
        """Bytes of the tensor's data in the checkpoint (from its header)."""
        return math.prod(self.shape(name)) * SAFETENSORS_ITEMSIZE[self.safetensors_dtype(name)]
