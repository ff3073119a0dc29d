"""The daemon's decisions, apart from its I/O: what to keep (``policy``), what to load ahead
(``scheduler``), from what is known of the live requests (``signals``).

Nothing here performs I/O, starts a thread or waits, so the trace replay (``replay.simulator``)
runs the same code as the daemon; ``docs/daemon.md`` draws how the pieces connect.
"""
