"""The test suite, a package: pytest imports each test file under ``tests/unit/`` by its dotted
name (``tests.unit.daemon.test_config``), so files in different folders may share a basename, and
the shared helpers are ``tests.<module>`` (stores, procs, waiting, ...)."""
