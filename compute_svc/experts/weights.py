"""The compute stage's input: one expert's weights in the compute dtype, from its arena slot.

::

    arena slot s [slot_bytes] uint8 ──views (Arena.slot_views)──▶ stored parts, e.g.
        gate_up_proj_blocks uint8 [2I, H/32, 16], gate_up_proj_scales uint8 [2I, H/32], ...
                           ──ExpertDecoder.weights──▶ {"gate_up_proj": bf16 [H, 2I], ...}

The store keeps experts in their checkpoint's encoding (``expertcache.encodings``), so every
tier moves the encoded bytes; here, inside the ExpertsInterface forward, each expert becomes
weights of the compute dtype at the last moment. Plain tensors are the arena views themselves
(no copy). MXFP4 and FP8 tensors are decoded on the arena's device (on CPU by the native core,
on a GPU by torch ops) into one scratch buffer per tensor, reused by every expert of every
layer: an expert's decoded tensor is valid until the same tensor of another expert is decoded,
which is after the GEMM that reads it (on a GPU, the same stream orders the kernels); the
experts forward decodes ``gate_up_proj`` expert by expert, then ``down_proj`` expert by expert. Scratch memory
is one expert's decoded bytes (``scratch_bytes``), plus the torch ops' index buffers on a GPU;
the arena holds only encoded blobs.

No maintained kernel package offers an MXFP4 or block-FP8 grouped matmul for torch 2.13 on
CPU (torchao's block-FP8 GEMM needs Triton and CUDA; transformers' MXFP4 kernels come from the
Hub at run time), so every device decodes first.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from expertcache.encodings import ExpertTensor, Scratch, decode

logger = logging.getLogger(__name__)


class ExpertDecoder:
    """Turns one expert's stored parts (views of an arena slot) into its runtime weights.

    ``tensors``: the manifest's expert tensors; ``device``: where the arena lives (the decode
    runs there, with its scratch buffers and tables). One per ExpertRuntime, used from its
    single worker thread.
    """

    def __init__(self, tensors: tuple[ExpertTensor, ...], device: torch.device | str) -> None:
        self.tensors = tensors
        self._by_name = {t.name: t for t in tensors}
        self.scratch = Scratch(device)
        self.encoded = tuple(t for t in tensors if t.encoding != "plain")
        if self.encoded:
            logger.info(
                "experts are stored encoded (%s): decoded at each use into %.1f MiB of scratch on %s",
                ", ".join(t.describe() for t in self.encoded),
                self.scratch_bytes / 2**20,
                self.scratch.device,
            )

    @property
    def scratch_bytes(self) -> int:
        """Decoded bytes of one expert's encoded tensors: the scratch the decode writes."""
        return sum(t.decoded_nbytes for t in self.encoded)

    def weights(self, parts: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{parameter name: tensor of the runtime shape and compute dtype}`` for one expert.

        ``parts``: stored part name → typed view of the slot (``Arena.slot_views``). Plain
        tensors come back as those views; encoded ones as views of this decoder's scratch.
        """
        if not self.encoded:
            return dict(parts)
        return {t.name: decode(t, parts, self.scratch) for t in self.tensors}

    def param(self, name: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One runtime parameter of one expert (``weights(parts)[name]``, decoding only it): a view
        of the slot when plain, else a view of this decoder's scratch for that tensor, valid until
        the same tensor of another expert is decoded."""
        tensor = self._by_name[name]
        if tensor.encoding == "plain":
            return parts[name]
        return decode(tensor, parts, self.scratch)
