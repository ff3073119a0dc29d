"""Shared pieces of ExpertCache used by more than one service.

Glossary (a worked example: Mixtral-8x7B, 32 decoder layers, 8 experts, top-2):
- *layer*: index of a decoder layer in the Hugging Face model (0..31). Only MoE layers hold
  experts; DeepSeek's first dense layers and Qwen2-MoE's ``mlp_only_layers`` do not.
- *expert*: index of a routed expert inside its layer (0..7). Shared experts are dense weights.
- ``ExpertKey(layer=3, expert=5)``: the unit the cache moves, one *blob* in the store.
- *blob*: all tensors of one expert (``gate_up_proj`` [2*14336, 4096] + ``down_proj``
  [4096, 14336], bf16 = 352 MiB) laid out contiguously, 4 KiB-aligned, in the runtime layout of
  transformers' stacked experts module, so a fetch is one read and compute takes views.
- *slot*: a fixed-size piece of the device arena (or host pool) that holds one blob.
"""
