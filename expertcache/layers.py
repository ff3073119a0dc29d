"""Layer numbers: decoder layers and MoE layers, and the one map between them.

Two numberings meet in this project, and every API says which it holds:

- a *decoder layer* is a layer number of the Hugging Face model, 0 .. num_layers-1.
  ``ExpertKey.layer``, the slot table's entries, the store manifest and the cache daemon's API
  (``moe.cache.v1``: ``decoder_layer`` fields) use it;
- a *MoE layer* is an index among the layers that have routed experts, 0 .. M-1.
  Expert activation matrices, the predictor's API (``moe.predictor.v1``: ``moe_layer`` fields)
  and routing traces use it.

``LayerMap`` (built from the manifest's ``moe_layers``) is the only place that translates. Example
(DeepSeek-V2-Lite: layer 0 is dense, 27 layers): ``LayerMap((1, 2, ..., 26))``; decoder layer 1 is
MoE layer 0, ``moe_index(5) == 4``, ``decoder(4) == 5``, ``ahead(26, 1) is None`` (the last MoE
layer has no successor), ``ahead(1, 2) == 3``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class LayerMap:
    """The model's MoE layers: ``moe_layers[i]`` is the decoder layer of MoE layer ``i``.

    ``num_layers``: the decoder layers of the model (default: the last MoE layer + 1)."""

    moe_layers: tuple[int, ...]
    num_layers: int = 0
    _index: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        layers = tuple(int(x) for x in self.moe_layers)
        if not layers:
            raise ValueError("a model needs at least one MoE layer")
        if any(b <= a for a, b in zip(layers, layers[1:], strict=False)) or layers[0] < 0:
            raise ValueError(f"moe_layers must be distinct ascending decoder layers >= 0, got {list(layers)}")
        num_layers = self.num_layers or layers[-1] + 1
        if num_layers <= layers[-1]:
            raise ValueError(f"MoE layer {layers[-1]} is outside {num_layers} decoder layers")
        object.__setattr__(self, "moe_layers", layers)
        object.__setattr__(self, "num_layers", num_layers)
        object.__setattr__(self, "_index", {layer: i for i, layer in enumerate(layers)})

    @classmethod
    def dense(cls, num_moe_layers: int) -> LayerMap:
        """Every layer is a MoE layer (decoder layer i = MoE layer i), as in a routing trace."""
        return cls(tuple(range(num_moe_layers)))

    @property
    def num_moe(self) -> int:
        return len(self.moe_layers)

    def is_moe(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has routed experts."""
        return int(layer) in self._index

    def moe_index(self, layer: int) -> int:
        """The MoE layer index of decoder layer ``layer``; ``ValueError`` if it has no experts."""
        try:
            return self._index[int(layer)]
        except KeyError:
            raise ValueError(
                f"decoder layer {layer} is not a MoE layer (MoE layers: {list(self.moe_layers)})"
            ) from None

    def decoder(self, moe_layer: int) -> int:
        """The decoder layer of MoE layer ``moe_layer``; ``ValueError`` outside 0..M-1."""
        if not 0 <= int(moe_layer) < len(self.moe_layers):
            raise ValueError(f"MoE layer {moe_layer} is outside 0..{len(self.moe_layers) - 1}")
        return self.moe_layers[int(moe_layer)]

    def ahead(self, layer: int, depth: int) -> int | None:
        """The decoder layer of the MoE layer ``depth`` MoE layers after decoder layer ``layer``
        (a MoE layer); None past the last one."""
        i = self.moe_index(layer) + int(depth)
        return self.moe_layers[i] if 0 <= i < len(self.moe_layers) else None

    def ranks(self) -> np.ndarray:
        """int64 [num_layers]: the MoE index of each decoder layer, -1 for a dense one."""
        out = np.full(self.num_layers, -1, np.int64)
        out[list(self.moe_layers)] = np.arange(len(self.moe_layers))
        return out
