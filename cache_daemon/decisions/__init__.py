"""The daemon's decisions, apart from its I/O: what to keep, what to load ahead, and when.

::

    compute / predictor messages ─▶ ActivationSignals (signals)   history, lookahead by depth, hints
                                          │
                     EvictionPolicy (policy/) ◀─┤─▶ PrefetchScheduler (scheduler)
                                          │              │ PrefetchQueue: loads in flight
                 TierState ◀── the daemon's residency (threads, I/O) or the replay's Simulation

Nothing here performs I/O, starts a thread or waits: every call returns at once and the caller
serialises calls (the daemon under its residency lock, the replay in its loop). So the trace
replay (``replay.simulator``) and the daemon run the same decision code, and only the tier and
the clock differ. Estimators that only the replay uses plug in through ``signals.Estimator``
(``replay.hazard``) and cost the daemon nothing.
"""
