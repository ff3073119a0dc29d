"""Tests of the cache daemon (cache_daemon/): tiers, residency, decisions, config, converter."""
