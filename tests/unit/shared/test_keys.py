"""ExpertKey and its entry index (the slot table's and the policies' numbering)."""

from __future__ import annotations

from expertcache.keys import ExpertKey


def test_entry_index_round_trip():
    assert ExpertKey(2, 5).entry(32) == 69
    assert ExpertKey.of_entry(69, 32) == ExpertKey(2, 5)
    seen = {ExpertKey(layer, expert).entry(8) for layer in range(4) for expert in range(8)}
    assert seen == set(range(32))  # dense, no collisions
    assert all(ExpertKey.of_entry(e, 8).entry(8) == e for e in range(32))
    assert str(ExpertKey(2, 5)) == "L2E5"
