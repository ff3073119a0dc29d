"""Trace replay and research: offline code that the services never import.

What lives here answers "what would the cache have done?" from a recorded routing trace, or
fits something the daemon later reads — never code a running service needs:

- the trace-replay simulator and its timing models (``simulator``),
- the batch-size ceiling of a trace (``batch_ceiling``),
- the reference eviction policies that need the future (``belady``, ``oracle``), built with the
  daemon's policies by ``policies.make_replay_policy``,
- the replay-only use estimate (``hazard``: ``HazardTable``, ``HazardEstimator``, an ``Estimator``
  of ``cache_daemon.decisions.signals``),
- the offline next-visit trainer (``python -m replay.learn_next_visit``; the daemon only reads
  its output with ``cache_daemon.decisions.next_visit``),
- forced routing, a benchmark mode of the compute service (``replay.forced_routing``).

``tests/unit/test_import_graph.py`` fails when ``compute_svc``, ``cache_daemon``,
``predictor_svc`` or ``expertcache`` import anything from this package.
"""
