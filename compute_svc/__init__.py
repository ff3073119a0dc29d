"""compute_svc: the GPU pod's main process.

Loads a model's config, tokenizer and dense weights from the expert store, runs generation and
serves ``moe.inference.v1.Inference``. Expert tensors are never materialised here: every MoE
layer's experts run from views into the cache daemon's arena (``moe.py``), acquired over the
daemon's Demand stream (``cache_client.py``).

Modules: ``config`` (ComputeConfig), ``server`` (gRPC edge and process assembly),
``scheduler`` (queue + single worker), ``generation`` (engine), ``model_loader`` (dense
weights), ``moe`` (experts forward), ``arena`` (arena views), ``cache_client`` (daemon
protocol), ``errors``, ``metrics``.
"""
