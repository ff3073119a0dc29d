"""Shared fixtures: tiny checkpoints converted to stores, built once per session.

``tiny_store(arch, **config)`` → ``TinyStore(checkpoint, store, manifest)``: a random-weight
checkpoint written by transformers (``devtools.tiny``) and its expert store (the real
converter). Equal arguments share one directory for the whole session.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `from tests.procs import ...` without an installed checkout
    sys.path.insert(0, str(REPO))

from expertcache.manifest import StoreManifest, read_manifest  # noqa: E402

# -- the order of a run: the longest files first ----------------------------------------------
# They build the native core four times and a wheel, or run the whole e2e benchmark: started
# first, they overlap the rest in a parallel run (make test: pytest-xdist, a file per worker at a
# time) instead of leaving one worker busy on them alone at the end.
LONGEST_FIRST = (
    "tests/distribution/test_native_matrix.py",
    "tests/distribution/test_wheel.py",
    "tests/integration/test_bench_e2e_smoke.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        rel = item.path.relative_to(REPO).as_posix() if item.path.is_relative_to(REPO) else ""
        return LONGEST_FIRST.index(rel) if rel in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: every other test keeps its place


# -- the last line of a run: skipped tests counted by reason -------------------------------------
_SKIPS: Counter[str] = Counter()


def pytest_runtest_logreport(report):
    if report.skipped:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        _SKIPS[reason.removeprefix("Skipped: ")] += 1


def pytest_unconfigure(config):
    """After pytest's own summary: which tests did not run here, and why (a machine without a
    GPU or without an optional package skips some; this says which, every time)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or not _SKIPS:
        return
    counts = "; ".join(f"{n} × {reason}" for reason, n in _SKIPS.most_common())
    reporter.write_line(f"skipped {sum(_SKIPS.values())}: {counts}")


@dataclass(frozen=True)
class TinyStore:
    checkpoint: Path
    store: Path
    manifest: StoreManifest


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory):
    built: dict[str, TinyStore] = {}

    def get(arch: str, *, columns: bool = False, **config) -> TinyStore:
        """``columns``: plain [in, out] expert parameters stored as the checkpoint has them, as
        stores converted before they were stored as rows (``expertcache.encodings.Plain``)."""
        key = f"{arch}-{columns}-{json.dumps(config, sort_keys=True, default=str)}"
        if key not in built:
            from unittest import mock

            from cache_daemon.convert import convert, converter
            from devtools.tiny import make_checkpoint

            root = tmp_path_factory.mktemp(arch)
            checkpoint = make_checkpoint(arch, root / "checkpoint", **config)
            sites = converter.find_experts_sites
            as_columns = mock.patch.object(
                converter, "find_experts_sites", lambda m: [replace(s, transposed=False) for s in sites(m)]
            )
            with as_columns if columns else contextlib.nullcontext():
                convert(checkpoint, root / "store")
            built[key] = TinyStore(checkpoint, root / "store", read_manifest(root / "store"))
        return built[key]

    return get


@pytest.fixture(scope="session")
def local_engine(tiny_store):
    """``local_engine(arch, slots=..., reverse=False, fused=True, graph=False, **config)`` →
    (engine, provider, TinyStore); ``fused=False`` keeps every layer on the torch path; ``graph``
    runs decode steps through compute_svc.engine.graph_step eagerly (its KV pool ``graph_rows`` x
    ``graph_tokens``) and decode-sized MoE layers through compute_svc.experts.slots.

    The real engine (dense weights from the store, experts from an in-memory arena) fed by
    ``LocalProvider`` instead of a daemon process.
    """

    def build(
        arch: str,
        *,
        slots: int | None = None,
        reverse: bool = False,
        limit: int = 256,
        fused: bool = True,
        graph: bool = False,
        graph_rows: int = 8,
        graph_tokens: int = 256,
        **config,
    ):
        import torch

        from compute_svc.engine.generation import GenerationEngine
        from compute_svc.engine.model_loader import load_model
        from compute_svc.experts.arena import Arena
        from compute_svc.experts.moe import ExpertRuntime, attach
        from tests.providers import LocalProvider

        tiny = tiny_store(arch, **config)
        manifest = tiny.manifest
        num_slots = slots if slots is not None else max(1, manifest.num_blobs // 4)
        arena = Arena(torch.zeros(num_slots, manifest.blob_bytes, dtype=torch.uint8))
        provider = LocalProvider(tiny.store, manifest, arena, reverse=reverse)
        loaded = load_model(tiny.store, manifest, torch.device("cpu"))
        runtime = ExpertRuntime(
            provider, arena, manifest.tensors, fused=fused, slotted=True if graph else None
        )
        attach(loaded.model, loaded.experts_modules, runtime)
        if not graph:
            return GenerationEngine(loaded, runtime, max_new_tokens_limit=limit), provider, tiny
        engine = GenerationEngine(
            loaded,
            runtime,
            max_new_tokens_limit=limit,
            native_decode=False,
            graph_step=True,
            graph_kv_rows=graph_rows,
            graph_kv_tokens=graph_tokens,
        )
        return engine, provider, tiny

    return build


@pytest.fixture
def real_memory_group():
    """A real memory cgroup of the benchmarks' (``devtools.memory_cgroup``), removed afterwards;
    skips where this machine cannot make one (not root, no memory controller)."""
    from devtools.memory_cgroup import MemoryCgroup

    group, note = MemoryCgroup.make("test")
    if group is None:
        pytest.skip(note)
    yield group
    group.remove()
