"""Tests of the shared library (expertcache/) and of what every service does through it."""
