"""The name of one expert: ``ExpertKey(layer, expert)``, and its *entry* index.

The entry index ``layer * num_experts + expert`` numbers every (layer, expert) of a model from 0:
it indexes the shared-memory slot table and every per-expert array of the policies and the
prediction signals. ``ExpertKey(2, 5).entry(32) == 69`` and ``ExpertKey.of_entry(69, 32) ==
ExpertKey(2, 5)``.
"""

from __future__ import annotations

from typing import NamedTuple


class ExpertKey(NamedTuple):
    """One routed expert of one decoder layer.

    ``layer`` is the decoder layer index in the Hugging Face model (not an index among MoE
    layers); ``expert`` is the expert index inside that layer. A named tuple: the daemon hashes
    and compares keys at every decision (policy orders, load queues, pins), and a tuple does both
    in C. Keys order by layer, then expert.
    """

    layer: int
    expert: int

    def entry(self, num_experts: int) -> int:
        """The entry index of this key in a model with ``num_experts`` experts per layer."""
        return self.layer * num_experts + self.expert

    @classmethod
    def of_entry(cls, entry: int, num_experts: int) -> ExpertKey:
        """The key of entry index ``entry`` (inverse of ``entry``)."""
        layer, expert = divmod(int(entry), num_experts)
        return cls(layer, expert)

    def __str__(self) -> str:
        return f"L{self.layer}E{self.expert}"
