"""Developer tools, kept apart from the library the services import and out of the wheel: the
process launcher the demo, tests and benchmarks share (``launch``), the demo (``python -m
devtools.demo``, ``make demo``), tiny random checkpoints (``tiny``), a throwaway
redis-server (``redis_server``), the chart's generated config schema (``gen_values_schema``, ``make
values-schema``) and the pinned Helm install (``install_helm``, ``make helm``). Nothing in compute_svc, cache_daemon, predictor_svc or
expertcache imports this package (tests/unit/test_import_graph.py)."""
