"""Developer tools, kept apart from the library the services import and out of the wheel: the
process launcher the demo, tests and benchmarks share (``launch``), the demo (``python -m
devtools.demo``, ``make demo``), tiny random checkpoints (``tiny``) and a throwaway
redis-server (``redis_server``). Nothing in compute_svc, cache_daemon, predictor_svc or
expertcache imports this package (tests/unit/test_import_graph.py)."""
