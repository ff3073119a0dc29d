"""Expert tensor encodings: how an expert's tensor is laid out in its blob, checked and decoded.

A store keeps experts in their checkpoint's encoding, so every tier moves the encoded bytes and
compute turns an expert into weights of the compute dtype at the last moment. One registry,
``ENCODINGS``, serves the converter (lay out), the manifest (check) and compute (decode)::

    encoding  stored parts, per expert (runtime parameter P)                 decoded → P
    plain     P             the runtime shape, in the compute dtype          the part itself (a view)
    mxfp4     P_blocks      uint8 [R, C/32, 16]: two E2M1 codes per byte     D [R, C] in the compute dtype;
              P_scales      uint8 [R, C/32]: E8M0, 2**(s - 127) per 32       P = D.T (``transposed``)
                            consecutive values of a row
    fp8       P             float8_e4m3fn [R, C]                             D [R, C] = P
              P_scale_inv   float32 [ceil(R/bm), ceil(C/bn)]: one multiplier per bm × bn block

Worked example, GPT-OSS-20b (H = I = 2880): the runtime ``gate_up_proj`` [H, 2I] is bf16
[2880, 5760] = 33.2 MB; it is stored as ``gate_up_proj_blocks`` uint8 [5760, 90, 16] (8.3 MB)
and ``gate_up_proj_scales`` uint8 [5760, 90] (0.5 MB): 3.8x fewer bytes to move.

Decoding equals transformers' own dequantisation on CPU bit for bit (tests compare every code
with every scale): MXFP4 as ``transformers.integrations.mxfp4.convert_moe_packed_tensors``, FP8
as ``transformers.integrations.finegrained_fp8.Fp8Dequantize`` (``q.float() * scale`` rounded once
to the compute dtype). Compute decodes every expert at every use, into preallocated buffers
(``Scratch``), by one of two paths that give the same bits::

    parts on   decoded by
    CPU        the native core (csrc/src/decode.cc): per-scale / per-block tables and SIMD
               look-ups in one pass, GIL released (an MXFP4 gpt-oss h512/i1280 expert: ~0.1 ms
               on a 2-core EPYC against 1-2 ms by the torch ops; ``make bench-decode``)
    CUDA       torch ops: table look-ups (index_select) and in-place products, with tables and
               buffers on the device

``native=False`` runs the torch ops on CPU too (tests compare the two paths). On CUDA a float
product (and possibly the rounding) returns the canonical NaN whatever its NaN operand, where x86
keeps the operand's sign and payload; so the torch-op FP8 path puts the e4m3 NaN codes' values
back from a table after the arithmetic (``_restore_fp8_nans``). MXFP4 has no NaN code and its
factors are finite powers of two, so no MXFP4 product is NaN on any device.
"""

from __future__ import annotations

import math
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import ClassVar

import torch


def _native_core():
    """The native core's module for the CPU decode, imported at the first decode (not with this
    module: the manifest imports it, and tests load another build of the core before any decode),
    or None without one (an install without its build: torch ops decode)."""
    global _NATIVE
    if _NATIVE is _UNLOADED:
        try:
            from expertcache import native as module
        except ImportError:  # pragma: no cover - every build has it
            module = None
        _NATIVE = module
    return _NATIVE


_UNLOADED = object()
_NATIVE = _UNLOADED

# Element sizes of the dtypes a stored part may have (torch names without "torch.").
DTYPE_ITEMSIZE = MappingProxyType(
    {
        "float32": 4,
        "float16": 2,
        "bfloat16": 2,
        "float64": 8,
        "float8_e4m3fn": 1,
        "int8": 1,
        "uint8": 1,
        "int32": 4,
        "int64": 8,
    }
)
# Dtypes an expert may be decoded into (the model's parameter dtype).
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")

if sys.byteorder != "little":  # pragma: no cover - every supported host and GPU is little-endian
    raise ImportError("expertcache.encodings reads packed codes as little-endian integers")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (e.g. "bfloat16"); ValueError for anything else."""
    dtype = getattr(torch, name, None)
    if name not in DTYPE_ITEMSIZE or not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}; valid: {', '.join(DTYPE_ITEMSIZE)}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- what a manifest records -----------------------------------------------------------------


@dataclass(frozen=True)
class TensorLayout:
    """One stored array inside every blob: ``shape`` elements of ``dtype`` at ``offset``."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "uint8"
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the blob

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class ExpertTensor:
    """One runtime parameter of an expert (``experts_module.<name>[e]``) and how it is stored.

    ``dtype``/``shape`` are the decoded (compute) tensor's; ``parts`` are the stored arrays;
    ``encoding`` names the entry of ``ENCODINGS`` that relates them, with its ``block_size``
    (values sharing one scale, as rows × columns of the decoded [R, C] matrix) and
    ``scale_layout``; ``transposed``: the parameter is the decoded matrix transposed.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    parts: tuple[TensorLayout, ...]
    encoding: str = "plain"
    block_size: tuple[int, ...] = ()
    scale_layout: str = ""
    transposed: bool = False

    @property
    def nbytes(self) -> int:
        """Stored (encoded) bytes, padding between parts excluded."""
        return sum(p.nbytes for p in self.parts)

    @property
    def decoded_nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]

    def describe(self) -> str:
        """e.g. ``gate_up_proj mxfp4 (blocks 1x32, ue8m0 scales) → bfloat16 [64, 128]``."""
        how = self.encoding
        if self.encoding != "plain":
            how += f" (blocks {'x'.join(map(str, self.block_size))}, {self.scale_layout} scales)"
        elif self.transposed:
            how += " (stored transposed, as rows)"
        return f"{self.name} {how} → {self.dtype} {list(self.shape)}"


class Scratch:
    """Work buffers on one device, reused by every decode (one expert at a time).

    ``get(key, shape, dtype)`` returns the buffer named ``key`` (reallocated only when it must
    grow), so decoding allocates nothing per expert; what a decode returns is valid until the
    next decode that uses the same keys. Tables are cached per device too. The last view of each
    key is kept, so asking again for the same shape costs no torch call (compute asks once per
    expert tensor per token).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # compare equal to tensors' cuda:N
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}
        # key → (its last view, that view's numpy array for the native decode, or None)
        self._views: dict[str, tuple[torch.Tensor, object]] = {}

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        last = self._views.get(key)
        if last is not None and last[0].dtype == dtype and last[0].shape == shape:
            return last[0]
        numel = math.prod(shape)
        buf = self._buffers.get(key)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=self.device)
            self._buffers[key] = buf
        view = buf[:numel].view(shape)
        self._views[key] = (view, None)
        return view

    def get_numpy(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, object]:
        """``get`` and a zero-copy numpy view of the same memory (``_numpy``: bf16/fp16 as int16
        bits), what the native decode writes into; CPU buffers only."""
        view = self.get(key, shape, dtype)
        last = self._views[key]
        if last[1] is None:
            last = (view, _numpy(view))
            self._views[key] = last
        return last

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def _use_native(native: bool | None, device: torch.device) -> bool:
    """Whether a decode of tensors on ``device`` runs natively: ``native=None`` (the default) on
    CPU when the native core has the decode; ``False``: torch ops; ``True``: native or ValueError."""
    available = _native_core() is not None  # whether CPU tensors can be decoded natively
    if native is None:
        return available and device.type == "cpu"
    if native and not (available and device.type == "cpu"):
        why = "the native core is not built" if not available else f"the tensors are on {device}"
        raise ValueError(f"the native decode runs on CPU tensors only, and {why}")
    return bool(native)


# Dtypes numpy lacks, viewed as integers of their size for the native decode.
_NUMPY_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float8_e4m3fn: torch.uint8}


def _numpy(tensor: torch.Tensor):
    """A zero-copy numpy view of a contiguous CPU tensor for the native decode: bf16/fp16 as their
    int16 bits, float8_e4m3fn as its bytes (numpy has neither dtype)."""
    bits = _NUMPY_BITS.get(tensor.dtype)
    return (tensor if bits is None else tensor.view(bits)).numpy()


# -- the encodings ---------------------------------------------------------------------------


class Encoding(ABC):
    """How one runtime parameter is stored: its parts, their checks, and the decode."""

    name: ClassVar[str]
    scale_layout: ClassVar[str] = ""

    @abstractmethod
    def plan(
        self, name: str, dtype: str, shape: tuple[int, ...], *, block_size: tuple[int, ...] = ()
    ) -> ExpertTensor:
        """The ExpertTensor of runtime parameter ``name`` (per expert ``shape``, ``dtype``); its
        parts carry offset 0 until ``expertcache.manifest.plan_blob`` places them."""

    @abstractmethod
    def part_shapes(self, tensor: ExpertTensor) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Stored part name → (dtype, shape) this encoding needs for ``tensor``."""

    def _plan_blocks(
        self,
        name: str,
        dtype: str,
        shape: tuple[int, ...],
        block_size: tuple[int, ...],
        *,
        transposed: bool = False,
    ) -> ExpertTensor:
        """``plan`` of a block-scaled encoding: the tensor in this encoding and scale layout, its
        parts laid out (at offset 0) from ``part_shapes``, which also checks shape and blocks."""
        tensor = ExpertTensor(
            name,
            dtype,
            tuple(shape),
            parts=(),
            encoding=self.name,
            block_size=block_size,
            scale_layout=self.scale_layout,
            transposed=transposed,
        )
        parts = tuple(TensorLayout(n, d, s, 0) for n, (d, s) in self.part_shapes(tensor).items())
        return replace(tensor, parts=parts)

    def check(self, tensor: ExpertTensor) -> None:
        """Raise ValueError naming ``tensor`` when its parts are not what the encoding needs."""
        if tensor.dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"expert tensor {tensor.name!r} decodes to {tensor.dtype!r}; valid: {', '.join(COMPUTE_DTYPES)}"
            )
        want = self.part_shapes(tensor)
        have = {p.name: (p.dtype, p.shape) for p in tensor.parts}
        if have != want:
            raise ValueError(
                f"expert tensor {tensor.name!r} ({tensor.encoding}, {list(tensor.shape)}, block "
                f"{list(tensor.block_size)}) has stored parts {have}; the encoding needs {want}"
            )

    @abstractmethod
    def decode(
        self, tensor: ExpertTensor, parts: Mapping[str, torch.Tensor], scratch: Scratch | None = None
    ) -> torch.Tensor:
        """The runtime parameter (``tensor.shape``, ``tensor.dtype``) from the stored ``parts``
        (name → tensor of the part's dtype and shape, e.g. views into an arena slot), on the
        parts' device. It may be a view of ``parts`` (plain) or of ``scratch`` buffers."""


class Plain(Encoding):
    """The runtime parameter as it is: bf16/fp16/fp32 checkpoints, biases. ``transposed``: a 2-D
    parameter stored transposed, [out, in] rows for a module that computes x @ W with W [in, out]
    (GPT-OSS), as its MXFP4 blocks are: the CPU kernels read a row of weights as one stream
    (docs/internals.md); the runtime parameter is the transposed view (no copy)."""

    name: ClassVar[str] = "plain"

    def plan(self, name, dtype, shape, *, block_size=(), transposed=False):
        if block_size:
            raise ValueError(f"plain tensor {name!r} has no blocks (got block size {list(block_size)})")
        tensor = ExpertTensor(name, dtype, tuple(shape), parts=(), transposed=transposed)
        ((part_dtype, part_shape),) = self.part_shapes(tensor).values()
        return replace(tensor, parts=(TensorLayout(name, part_dtype, part_shape, 0),))

    def part_shapes(self, tensor):
        if tensor.transposed:
            if len(tensor.shape) != 2:
                raise ValueError(
                    f"plain tensor {tensor.name!r} is transposed but {list(tensor.shape)} is not 2-D"
                )
            return {tensor.name: (tensor.dtype, tuple(tensor.shape[::-1]))}
        return {tensor.name: (tensor.dtype, tensor.shape)}

    def decode(self, tensor, parts, scratch=None):
        return parts[tensor.name].t() if tensor.transposed else parts[tensor.name]


# -- MXFP4 --------------------------------------------------------------------------------------

MXFP4_GROUP = 32  # values sharing one scale
MXFP4_BYTES_PER_GROUP = MXFP4_GROUP // 2  # two E2M1 codes per byte
E8M0_BIAS = 127
# E2M1 code → value; codes 8..15 are the negatives of 0..7 (the top bit is the sign).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS_SUFFIX, SCALES_SUFFIX, SCALE_INV_SUFFIX = "_blocks", "_scales", "_scale_inv"

_TABLES: dict[tuple[str, str, torch.device], torch.Tensor] = {}


def _table(kind: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (kind, dtype_name(dtype), device)
    table = _TABLES.get(key)
    if table is None:
        table = _TABLE_BUILDERS[kind](dtype).to(device)
        _TABLES[key] = table
    return table


def _code_table(dtype: torch.dtype) -> torch.Tensor:
    """int64 [2**(8n)]: entry w holds the 8/itemsize values of ``dtype`` that the n = itemsize/2
    little-endian bytes of w decode to, low nibble first (transformers' order: even = low),
    each *twice* its E2M1 value (see ``_scale_table``)."""
    per_entry = 8 // dtype.itemsize  # 4 bf16/fp16 values (2 bytes), 2 float32 values (1 byte)
    nbytes = per_entry // 2
    words = torch.arange(1 << (8 * nbytes), dtype=torch.int64)
    nibbles = [(words >> (4 * i)) & 0xF for i in range(per_entry)]
    lut = 2 * torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack([lut[n] for n in nibbles], dim=-1).to(dtype)  # exact in every float dtype
    return values.contiguous().view(torch.int64).reshape(-1)


def _scale_table(dtype: torch.dtype) -> torch.Tensor:
    """[256] ``dtype``: 2 ** (s - 128), half the E8M0 scale 2 ** (s - 127).

    transformers applies the scale with ``torch.ldexp`` (value × 2**e, exact, rounded once).
    2**128 (s = 255) has no float32 value but 2**127 has, and 2 × E2M1 is still exact, so
    (2 v) × 2**(s - 128) is that exact product for every s, ldexp(0, 128) = 0 included. Every
    factor is exact in bfloat16 and float32, and so is each product before its one rounding.
    """
    exponents = torch.arange(256, dtype=torch.int32) - (E8M0_BIAS + 1)
    return torch.ldexp(torch.ones(256, dtype=torch.float32), exponents).to(dtype)


E4M3_NAN_CODES = (0x7F, 0xFF)  # float8_e4m3fn has no infinities: these two bytes are its NaNs


def _fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """int64 [65536]: entry w holds the float32 values of the two e4m3 bytes of w (low first)."""
    words = torch.arange(1 << 16, dtype=torch.int64)
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    values = torch.stack([e4m3[words & 0xFF], e4m3[words >> 8]], dim=-1)
    return values.contiguous().view(torch.int64).reshape(-1)


def _fp8_nan_table(dtype: torch.dtype) -> torch.Tensor:
    """[2] ``dtype``: what transformers' CPU dequantisation gives for the e4m3 NaN codes 0x7F and
    0xFF (``E4M3_NAN_CODES``): their float32 values (quiet NaNs 0x7FF00000 / 0xFFF00000, which an
    x86 product by any scale keeps) rounded by torch's CPU conversion. On x86 that is
    bf16 0xFFFF for both (torch's vectorised rounding drops a NaN's sign) and fp16 0x7F80 / 0xFF80.
    Always built on the CPU: the reference is the CPU's bits."""
    codes = torch.tensor(E4M3_NAN_CODES, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return codes.to(torch.float32).to(dtype)


_TABLE_BUILDERS = {"codes": _code_table, "scales": _scale_table, "fp8": _fp8_table, "fp8_nan": _fp8_nan_table}


def dequantize_mxfp4(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype,
    scratch: Scratch | None = None,
    key: str = "mxfp4",
    *,
    native: bool | None = None,
) -> torch.Tensor:
    """``blocks`` uint8 [R, G, 16], ``scales`` uint8 [R, G] → ``dtype`` [R, G*32] (row-major),
    the ``scratch`` buffer ``key``.values (reused by the next decode with the same key).

    value[r, 32g + 2k] = FP4[blocks[r, g, k] & 0xF] * 2**(scales[r, g] - 127), +1: the high
    nibble. On CPU (``native`` None or True) the native core decodes in one pass: a group's 32
    values take only the 16 values of its scale, looked up in a [256 scales, 16 codes] table per
    dtype built once with the same exact products. The torch ops (CUDA, or ``native=False``)
    look up one table entry per 2 bytes (per byte for float32) into the output buffer, then
    multiply in place by the group's scale. bfloat16 and float32 multiply in their own dtype
    (every product is exact, as in transformers' float32 product then rounding); float16 is
    formed in float32 and rounded once, as transformers does. Every factor is finite (at most
    2**127, see ``_scale_table``), so no value is NaN, on CUDA either.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks/scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 3 or blocks.shape[-1] != MXFP4_BYTES_PER_GROUP or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
            f"(expected blocks [R, G, {MXFP4_BYTES_PER_GROUP}] and scales [R, G])"
        )
    scratch = scratch or Scratch(blocks.device)
    if scratch.device != blocks.device:
        raise ValueError(f"scratch on {scratch.device}, blocks on {blocks.device}")
    rows, groups, nbytes = blocks.shape
    if _use_native(native, blocks.device):
        out, out_array = scratch.get_numpy(f"{key}.values", (rows, groups * MXFP4_GROUP), dtype)
        _native_core().decode_mxfp4(
            _numpy(blocks.contiguous()), _numpy(scales.contiguous()), out_array, dtype_name(dtype)
        )
        return out
    work = torch.float32 if dtype == torch.float16 else dtype
    codes = _table("codes", work, blocks.device)
    per_entry = 8 // work.itemsize
    entries = rows * groups * nbytes * 2 // per_entry
    # Index of each table entry: the next 2 bytes (1 for float32) as an unsigned integer.
    packed = blocks.contiguous().view(-1)
    index = scratch.get(f"{key}.index", (entries,), torch.int32)
    index.copy_(packed.view(torch.uint16) if per_entry == 4 else packed)  # zero-extends
    values = scratch.get(f"{key}.work" if work is not dtype else f"{key}.values", (entries,), torch.int64)
    torch.index_select(codes, 0, index, out=values)
    values = values.view(work).view(rows, groups, MXFP4_GROUP)
    exponents = scratch.get(f"{key}.exponents", (rows * groups,), torch.int32)
    exponents.copy_(scales.reshape(-1))
    factors = scratch.get(f"{key}.scales", (rows * groups,), work)
    torch.index_select(_table("scales", work, blocks.device), 0, exponents, out=factors)
    values.mul_(factors.view(rows, groups, 1))
    if work is not dtype:
        out = scratch.get(f"{key}.values", (rows, groups * MXFP4_GROUP), dtype)
        out.copy_(values.view(rows, -1))
        return out
    return values.view(rows, groups * MXFP4_GROUP)


class Mxfp4(Encoding):
    """OCP Microscaling FP4 as GPT-OSS checkpoints ship their experts (``*_blocks``/``*_scales``).

    The blocks' rows are the *output* features (the checkpoint's orientation), so the decoded
    [R, C] matrix is the runtime parameter transposed: GPT-OSS holds ``gate_up_proj`` [H, 2I]
    (x @ W) while its blocks are [2I, H/32, 16]. Compute uses the transposed view (no copy).
    """

    name: ClassVar[str] = "mxfp4"
    scale_layout: ClassVar[str] = "ue8m0"  # uint8 biased exponent per 1 x 32 block of a row

    def plan(self, name, dtype, shape, *, block_size=(1, MXFP4_GROUP)):
        if tuple(block_size) != (1, MXFP4_GROUP):
            raise ValueError(f"MXFP4 tensor {name!r}: block size must be [1, 32], got {list(block_size)}")
        return self._plan_blocks(name, dtype, shape, (1, MXFP4_GROUP), transposed=True)

    def part_shapes(self, tensor):
        if len(tensor.shape) != 2 or not tensor.transposed:
            raise ValueError(
                f"MXFP4 tensor {tensor.name!r}: a transposed 2-D parameter is needed, got "
                f"{list(tensor.shape)} (transposed={tensor.transposed})"
            )
        if tuple(tensor.block_size) != (1, MXFP4_GROUP) or tensor.scale_layout != self.scale_layout:
            raise ValueError(
                f"MXFP4 tensor {tensor.name!r}: block size {list(tensor.block_size)} / scale layout "
                f"{tensor.scale_layout!r}; only [1, 32] / {self.scale_layout!r} exist"
            )
        columns, rows = tensor.shape  # runtime [C, R]: the decoded [R, C] transposed
        if columns % MXFP4_GROUP:
            raise ValueError(
                f"MXFP4 tensor {tensor.name!r}: {columns} input features are not a multiple of {MXFP4_GROUP}"
            )
        groups = columns // MXFP4_GROUP
        return {
            tensor.name + BLOCKS_SUFFIX: ("uint8", (rows, groups, MXFP4_BYTES_PER_GROUP)),
            tensor.name + SCALES_SUFFIX: ("uint8", (rows, groups)),
        }

    def decode(self, tensor, parts, scratch=None):
        decoded = dequantize_mxfp4(
            parts[tensor.name + BLOCKS_SUFFIX],
            parts[tensor.name + SCALES_SUFFIX],
            torch_dtype(tensor.dtype),
            scratch,
            key=tensor.name,
        )  # [R, C]
        return decoded.t()  # [C, R]: the runtime parameter, as a transposed view


# -- FP8 ------------------------------------------------------------------------------------------


def dequantize_fp8(
    values: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    dtype: torch.dtype,
    scratch: Scratch | None = None,
    key: str = "fp8",
    *,
    native: bool | None = None,
) -> torch.Tensor:
    """``values`` float8_e4m3fn [R, C], ``scale_inv`` float32 [ceil(R/bm), ceil(C/bn)] → ``dtype``
    [R, C]: ``values.float() * scale_inv`` of each value's block, rounded once to ``dtype``.

    That is transformers' ``(q.float() * s).to(dtype)``. On CPU (``native`` None or True) the
    native core does it in one pass (bf16/fp16: each block's 256 possible outputs computed once,
    then looked up). The torch ops (CUDA, or ``native=False``) form it in float32 (an exact copy
    of the e4m3 values, then in-place products per block), round it to ``dtype`` at the end, and
    put the NaN codes' values back from a table (``_restore_fp8_nans``: CUDA's arithmetic loses a
    NaN's sign). A last partial block (R or C not a multiple of the block) takes its block's
    scale, as DeepSeek's reference dequantisation does.
    """
    if values.dtype != torch.float8_e4m3fn or scale_inv.dtype != torch.float32:
        raise ValueError(
            f"FP8 values/scales must be float8_e4m3fn/float32, got {values.dtype}/{scale_inv.dtype}"
        )
    if values.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(f"FP8 values {tuple(values.shape)} and scales {tuple(scale_inv.shape)} must be 2-D")
    rows, cols = values.shape
    bm, bn = block_size
    grid = (math.ceil(rows / bm), math.ceil(cols / bn))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"FP8 values {tuple(values.shape)} with blocks {bm}x{bn} need scales {grid}, got {tuple(scale_inv.shape)}"
        )
    scratch = scratch or Scratch(values.device)
    if scratch.device != values.device:
        raise ValueError(f"scratch on {scratch.device}, values on {values.device}")
    if _use_native(native, values.device):
        out, out_array = scratch.get_numpy(f"{key}.values", (rows, cols), dtype)
        codes, factors = _numpy(values.contiguous()), _numpy(scale_inv.contiguous())
        _native_core().decode_fp8(codes, factors, bm, bn, out_array, dtype_name(dtype))
        return out
    work = scratch.get(f"{key}.f32", (rows, cols), torch.float32)
    _e4m3_to_float32(values, work, scratch, key)
    full_r, full_c = rows // bm * bm, cols // bn * bn
    sr, sc = full_r // bm, full_c // bn
    if sr and sc:  # whole blocks: [sr, bm, sc, bn] view × [sr, 1, sc, 1] scales, in place
        body = work[:full_r, :full_c].unflatten(1, (sc, bn)).unflatten(0, (sr, bm))
        _mul_(body, scale_inv[:sr, :sc].view(sr, 1, sc, 1))
    for r0, r1, c0, c1 in (
        (0, full_r, full_c, cols),  # right edge (partial column block)
        (full_r, rows, 0, full_c),  # bottom edge (partial row block)
        (full_r, rows, full_c, cols),  # corner
    ):
        if r1 > r0 and c1 > c0:
            s = scale_inv[r0 // bm : math.ceil(r1 / bm), c0 // bn : math.ceil(c1 / bn)]
            s = s.repeat_interleave(bm, 0)[: r1 - r0].repeat_interleave(bn, 1)[:, : c1 - c0]
            _mul_(work[r0:r1, c0:c1], s)
    out = work
    if dtype != torch.float32:
        out = scratch.get(f"{key}.values", (rows, cols), dtype)
        _round_into(out, work)
    _restore_fp8_nans(out, values, scratch, key)
    return out


def _mul_(values: torch.Tensor, factors: torch.Tensor) -> None:
    """``values *= factors`` in place: the torch-op FP8 path's products (one function, so that a
    test can stand in CUDA's NaN rule for them on CPU)."""
    values.mul_(factors)


def _round_into(out: torch.Tensor, values: torch.Tensor) -> None:
    """``out`` = float32 ``values`` rounded to ``out``'s dtype (a seam for tests, as ``_mul_``)."""
    out.copy_(values)


def _restore_fp8_nans(out: torch.Tensor, values: torch.Tensor, scratch: Scratch, key: str) -> None:
    """Where ``values`` (float8_e4m3fn) holds a NaN code, ``out`` takes that code's output from
    ``_fp8_nan_table`` instead of what the arithmetic made of it.

    Transformers' reference is an x86 CPU, where a product keeps its NaN operand's sign and
    payload (0xFF: float32 0xFFF00000 times any scale is 0xFFF00000). A CUDA product returns the
    canonical NaN 0x7FFFFFFF instead, so the torch ops alone gave +NaN for 0xFF on a GPU (bf16
    0x7FFF against transformers' 0xFFFF). The value is put back after the rounding, not between
    the product and the rounding: torch's CPU rounding to bf16 makes every NaN 0xFFFF, which a
    GPU's conversion (canonical 0x7FFF, or the truncated 0xFFF0) does not reproduce. So the bits
    are the reference's on every device, whatever its product and conversion do with a NaN. A
    NaN code times a NaN scale gives the code's NaN (the native decode's rule; transformers' own
    bits there depend on its loop). Element-wise torch ops only (no host sync), two passes per
    NaN code.
    """
    raw = values.contiguous().view(torch.uint8)
    hit = scratch.get(f"{key}.nan", tuple(raw.shape), torch.bool)
    nans = _table("fp8_nan", out.dtype, out.device)
    for i, code in enumerate(E4M3_NAN_CODES):
        torch.eq(raw, code, out=hit)
        torch.where(hit, nans[i], out, out=out)


def _e4m3_to_float32(values: torch.Tensor, out: torch.Tensor, scratch: Scratch, key: str) -> None:
    """``out`` (float32, ``values``' shape) = ``values`` (float8_e4m3fn): exact, by table look-up
    of two bytes at a time (torch's own e4m3 → float conversion is element by element on CPU)."""
    raw = values.contiguous().view(torch.uint8).view(-1)
    if raw.numel() % 2:
        out.copy_(values)
        return
    index = scratch.get(f"{key}.index", (raw.numel() // 2,), torch.int32)
    index.copy_(raw.view(torch.uint16))  # zero-extends
    pairs = out.view(-1).view(torch.int64)  # [numel / 2] pairs of float32
    torch.index_select(_table("fp8", torch.float32, values.device), 0, index, out=pairs)


class Fp8(Encoding):
    """Block-scaled FP8 (e4m3) as DeepSeek-V3/R1 and the Qwen3 FP8 releases ship their weights:
    ``weight`` float8_e4m3fn [R, C] and ``weight_scale_inv`` float32, one per bm × bn block."""

    name: ClassVar[str] = "fp8"
    scale_layout: ClassVar[str] = "float32"  # multiplier per block (the checkpoint's weight_scale_inv)

    def plan(self, name, dtype, shape, *, block_size=(128, 128)):
        return self._plan_blocks(name, dtype, shape, tuple(int(b) for b in block_size))

    def part_shapes(self, tensor):
        if len(tensor.shape) != 2 or tensor.transposed:
            raise ValueError(
                f"FP8 tensor {tensor.name!r}: a 2-D parameter is needed, got {list(tensor.shape)}"
            )
        if len(tensor.block_size) != 2 or min(tensor.block_size) < 1:
            raise ValueError(
                f"FP8 tensor {tensor.name!r}: block size {list(tensor.block_size)} is not [bm, bn]"
            )
        if tensor.scale_layout != self.scale_layout:
            raise ValueError(
                f"FP8 tensor {tensor.name!r}: scale layout {tensor.scale_layout!r}; only {self.scale_layout!r} exists"
            )
        rows, cols = tensor.shape
        bm, bn = tensor.block_size
        return {
            tensor.name: ("float8_e4m3fn", (rows, cols)),
            tensor.name + SCALE_INV_SUFFIX: ("float32", (math.ceil(rows / bm), math.ceil(cols / bn))),
        }

    def decode(self, tensor, parts, scratch=None):
        return dequantize_fp8(
            parts[tensor.name],
            parts[tensor.name + SCALE_INV_SUFFIX],
            tensor.block_size,
            torch_dtype(tensor.dtype),
            scratch,
            key=tensor.name,
        )


ENCODINGS: Mapping[str, Encoding] = MappingProxyType({e.name: e for e in (Plain(), Mxfp4(), Fp8())})


def get_encoding(name: str) -> Encoding:
    """The registered encoding ``name``; ValueError listing the valid ones otherwise."""
    try:
        return ENCODINGS[name]
    except KeyError:
        raise ValueError(f"unknown expert encoding {name!r}; valid: {', '.join(ENCODINGS)}") from None


def check_tensor(tensor: ExpertTensor) -> None:
    """ValueError naming ``tensor`` when its encoding is unknown or its parts do not fit it."""
    for part in tensor.parts:
        if part.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(
                f"stored part {part.name!r} has unknown dtype {part.dtype!r}; valid: {', '.join(DTYPE_ITEMSIZE)}"
            )
    get_encoding(tensor.encoding).check(tensor)


def decode(
    tensor: ExpertTensor, parts: Mapping[str, torch.Tensor], scratch: Scratch | None = None
) -> torch.Tensor:
    """``tensor``'s runtime parameter from its stored ``parts`` (see ``Encoding.decode``)."""
    return get_encoding(tensor.encoding).decode(tensor, parts, scratch)


__all__ = [
    "COMPUTE_DTYPES",
    "DTYPE_ITEMSIZE",
    "ENCODINGS",
    "Encoding",
    "ExpertTensor",
    "Scratch",
    "TensorLayout",
    "check_tensor",
    "decode",
    "dequantize_fp8",
    "dequantize_mxfp4",
    "get_encoding",
]
