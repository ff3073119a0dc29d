"""Expert Activation Matrices (EAM): one request's routing as a token count per (layer, expert).

Glossary, with a worked example (2 layers, 4 experts, top-2):

    token 0 routes layer 0 → experts (1, 3), layer 1 → (0, 1)
    token 1 routes layer 0 → experts (1, 2), layer 1 → (0, 3)

    EAM (uint32 [layers, experts]):   layer 0: [0, 2, 1, 1]
                                      layer 1: [2, 1, 0, 1]

An entry of the EAM collection (EAMC) is one finished request's EAM plus its token count,
stored as raw bytes with a versioned little-endian header (never pickle):

    offset  size  field
    0       4     magic b"EAM\\x01"
    4       2     version (u16, currently 1)
    6       2     reserved (u16, 0) – keeps the counts 4-byte aligned
    8       4     layers (u32)
    12      4     experts (u32)
    16      4     tokens (u32)
    20      4     crc32 of the payload (u32) – catches bit rot a length check cannot
    24      L*E*4 counts, uint32 little-endian, row-major [layers, experts]
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from predictor_svc.errors import CorruptEntry

MAGIC = b"EAM\x01"
VERSION = 1
_HEADER = struct.Struct("<4sHHIIII")
HEADER_BYTES = _HEADER.size  # 24
# A bound on the header's dimensions so a corrupt header cannot make us allocate gigabytes.
_MAX_CELLS = 1 << 24
# The one grammar of a shape's text, LAYERSxEXPERTSxTOP_K (the config's entries embed it).
SHAPE_PATTERN = r"(?P<layers>\d+)x(?P<experts>\d+)x(?P<top_k>\d+)"
_SHAPE_RE = re.compile(SHAPE_PATTERN)


@dataclass(frozen=True)
class EamShape:
    """The routing geometry of one model: MoE ``layers`` × ``experts``, ``top_k`` per token.

    The one shape type of the predictor: configured (``model_shapes``), registered
    (RegisterModel), kept in the store's model catalog as its text (``"24x32x4"``) and sizing
    every EAM."""

    layers: int
    experts: int
    top_k: int

    def __post_init__(self) -> None:
        for name in ("layers", "experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EamShape.{name} must be a positive int, got {value!r}")
        if self.top_k > self.experts:
            raise ValueError(f"EamShape.top_k ({self.top_k}) must not exceed experts ({self.experts})")
        if self.layers * self.experts > _MAX_CELLS:
            raise ValueError(f"EamShape {self.layers}x{self.experts} exceeds {_MAX_CELLS} cells")

    @classmethod
    def parse(cls, text: str) -> EamShape:
        """``"24x32x4"`` → EamShape; ValueError when ``text`` is not LAYERSxEXPERTSxTOP_K or
        not a valid shape (the message names which)."""
        match = _SHAPE_RE.fullmatch(text)
        if match is None:
            raise ValueError(f"shape {text!r} is not LAYERSxEXPERTSxTOP_K")
        return cls(int(match["layers"]), int(match["experts"]), int(match["top_k"]))

    @property
    def text(self) -> str:
        """``"LAYERSxEXPERTSxTOP_K"``, as ``parse`` reads it back."""
        return f"{self.layers}x{self.experts}x{self.top_k}"

    @property
    def cells(self) -> int:
        return self.layers * self.experts


def new_eam(shape: EamShape) -> np.ndarray:
    """An empty EAM: uint32 [layers, experts] of zeros."""
    return np.zeros((shape.layers, shape.experts), dtype=np.uint32)


def add_token(eam: np.ndarray, experts: np.ndarray) -> None:
    """Count one token's routing into ``eam`` (uint32 [L, E]) in place.

    ``experts``: int [L, K], the experts each layer routed to; a row (or single cells) of -1
    marks layers not seen yet (a partial token). Raises ValueError on a shape mismatch or an
    expert id out of range.
    """
    experts = np.asarray(experts)
    layers, n_experts = eam.shape
    if experts.ndim != 2 or experts.shape[0] != layers:
        raise ValueError(f"experts must be int [{layers}, top_k], got shape {experts.shape}")
    if experts.dtype.kind not in "iu":
        raise ValueError(f"experts must be an integer array, got dtype {experts.dtype}")
    seen = experts >= 0
    if np.any(experts[seen] >= n_experts):
        raise ValueError(f"expert id {int(experts[seen].max())} out of range for {n_experts} experts")
    rows = np.broadcast_to(np.arange(layers)[:, None], experts.shape)
    # np.add.at counts a duplicate (layer, expert) twice, which plain fancy-index += would not.
    np.add.at(eam, (rows[seen], experts[seen].astype(np.intp)), 1)


def encode_eam(eam: np.ndarray, tokens: int) -> bytes:
    """Serialise ``eam`` (uint32 [L, E]) and its token count to the versioned entry format."""
    if eam.ndim != 2:
        raise ValueError(f"eam must be 2-D [layers, experts], got shape {eam.shape}")
    if tokens < 0 or tokens > 0xFFFFFFFF:
        raise ValueError(f"tokens must fit in u32, got {tokens}")
    payload = np.ascontiguousarray(eam, dtype="<u4").tobytes()
    layers, experts = eam.shape
    header = _HEADER.pack(MAGIC, VERSION, 0, layers, experts, int(tokens), zlib.crc32(payload))
    return header + payload


def decode_eam(blob: bytes, shape: EamShape | None = None) -> tuple[np.ndarray, int]:
    """Parse an entry back to (uint32 [L, E] EAM, tokens).

    Raises CorruptEntry naming the problem: short header, bad magic, unknown version, payload
    size not matching layers × experts, checksum mismatch, or (when ``shape`` is given) an
    entry of another model's geometry.
    """
    blob = bytes(blob)
    if len(blob) < HEADER_BYTES:
        raise CorruptEntry(f"EAM entry truncated: {len(blob)} bytes, the header alone is {HEADER_BYTES}")
    magic, version, _reserved, layers, experts, tokens, crc = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptEntry(f"EAM entry has bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise CorruptEntry(f"EAM entry has unknown version {version}, this reader knows {VERSION}")
    if layers < 1 or experts < 1 or layers * experts > _MAX_CELLS:
        raise CorruptEntry(f"EAM entry header has impossible shape {layers}x{experts}")
    expected = HEADER_BYTES + layers * experts * 4
    if len(blob) != expected:
        raise CorruptEntry(
            f"EAM entry size {len(blob)} bytes does not match {layers}x{experts} uint32 "
            f"(expected {expected} bytes: truncated or trailing garbage)"
        )
    if shape is not None and (layers, experts) != (shape.layers, shape.experts):
        raise CorruptEntry(
            f"EAM entry shape {layers}x{experts} does not match the model's {shape.layers}x{shape.experts}"
        )
    payload = blob[HEADER_BYTES:]
    if zlib.crc32(payload) != crc:
        raise CorruptEntry(f"EAM entry checksum mismatch (header crc32 {crc:#010x})")
    eam = np.frombuffer(payload, dtype="<u4").reshape(layers, experts).astype(np.uint32)
    return eam, tokens
