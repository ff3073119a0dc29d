"""Tests of trace replay and research code: simulator, batch ceiling, forced routing, next-visit."""
