"""The name of one expert: ``ExpertKey(layer, expert)``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True, slots=True)
class ExpertKey:
    """One routed expert of one decoder layer.

    ``layer`` is the decoder layer index in the Hugging Face model (not an index among MoE
    layers); ``expert`` is the expert index inside that layer.
    """

    layer: int
    expert: int

    def __str__(self) -> str:
        return f"L{self.layer}E{self.expert}"
