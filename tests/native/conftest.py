"""The native tests run against the installed native core (``expertcache._native``), or against
another build of it given by ``--native-lib PATH`` (what tests/distribution/test_native_matrix.py does
for each configuration of optional features). That build is loaded under the installed module's
name before any test module imports ``expertcache.native``, so every test sees it.
"""

from __future__ import annotations

import importlib.util
import sys


def pytest_addoption(parser):
    parser.addoption(
        "--native-lib",
        default=None,
        help="path of a built expertcache._native extension to test instead of the installed one",
    )


def pytest_configure(config):
    path = config.getoption("--native-lib")
    if not path:
        return
    if "expertcache._native" in sys.modules:
        raise RuntimeError("--native-lib must be given before expertcache._native is imported")
    spec = importlib.util.spec_from_file_location("expertcache._native", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"--native-lib {path}: not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["expertcache._native"] = module
