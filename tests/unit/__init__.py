"""Unit tests, one folder per part of the house: daemon, compute, predictor, shared (expertcache), replay."""
