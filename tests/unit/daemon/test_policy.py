"""The eviction policy registry and LRU order."""

from __future__ import annotations

from cache_daemon.decisions.policy import LRUPolicy
from expertcache.keys import ExpertKey

A, B, C, D = (ExpertKey(1, e) for e in range(4))


def test_lru_order_access_and_remove():
    lru = LRUPolicy()
    for key in (A, B, C, D):
        lru.on_insert(key)
    lru.on_access(A)  # A becomes the most recent
    assert lru.choose_victims(4, lambda k: True) == [B, C, D, A]
    assert lru.choose_victims(2, lambda k: True) == [B, C]
    assert len(lru) == 4  # choosing changes nothing
    lru.on_remove(B)
    lru.on_remove(B)  # unknown keys are ignored
    lru.on_access(B)  # so is an access to a key that is not tracked
    assert lru.choose_victims(1, lambda k: True) == [C]
    assert len(lru) == 3


def test_lru_skips_keys_the_tier_says_are_pinned():
    lru = LRUPolicy()
    for key in (A, B, C):
        lru.on_insert(key)
    pinned = {A, C}
    assert lru.choose_victims(2, lambda k: k not in pinned) == [B]
    assert lru.choose_victims(1, lambda k: False) == []
    assert lru.choose_victims(0, lambda k: True) == []
    lru.on_insert(A)  # re-inserting moves to the most recent end
    assert lru.choose_victims(3, lambda k: True) == [B, C, A]
