"""compute_svc: the GPU pod's main process, serving ``moe.inference.v1.Inference`` (and HTTP).

Rooms, each importing only those below it: ``http`` (the OpenAI-compatible front door),
``engine`` (requests, batching, the forward), ``daemon`` (the link to the cache daemon),
``experts`` (a MoE layer's experts over the daemon's arena). ``server`` assembles them;
``config``, ``errors`` and ``metrics`` serve all. Design: docs/compute.md.
"""
