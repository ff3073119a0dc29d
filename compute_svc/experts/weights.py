"""The compute stage's input: one expert's weights in the compute dtype, from its arena slot.

Experts travel in their checkpoint's encoding; MXFP4 and FP8 parts are decoded here, at the last
moment, into scratch buffers reused by every expert. Design: docs/compute.md."""

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
        tensors come back as those views (transposed ones as their transposed view); encoded ones
        as views of this decoder's scratch.
        """
        return {t.name: decode(t, parts, self.scratch) for t in self.tensors}

    def param(self, name: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One runtime parameter of one expert (``weights(parts)[name]``, decoding only it): a view
        of the slot when plain, else a view of this decoder's scratch for that tensor, valid until
        the same tensor of another expert is decoded."""
        return decode(self._by_name[name], parts, self.scratch)
