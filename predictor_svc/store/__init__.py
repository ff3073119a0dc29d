"""EAMC stores: where each model's EAM collection lives. ``open_store`` picks one.

No Redis URL → the embedded store (optionally loaded from / saved to a file); a URL → Redis,
chosen by URL scheme from a registry (unknown schemes raise ValueError listing the valid ones).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from predictor_svc.store.base import Change, EamcStore
from predictor_svc.store.embedded import EmbeddedStore


def _open_redis(url: str) -> EamcStore:
    from predictor_svc.store.redis_store import RedisStore  # noqa: PLC0415 - only with a URL

    return RedisStore(url)


# URL scheme -> factory. redis-py understands all three.
_URL_STORES: dict[str, Callable[[str], EamcStore]] = {
    "redis": _open_redis,
    "rediss": _open_redis,
    "unix": _open_redis,
}


def open_store(redis_url: str | None, embedded_path: Path | None = None) -> EamcStore:
    """The store for this configuration: Redis at ``redis_url``, else the embedded store.

    The embedded store is loaded from ``embedded_path`` when the file exists and saved there on
    ``close()``; without a path it lives in memory only.
    """
    if not redis_url:
        if embedded_path is None:
            return EmbeddedStore()
        return EmbeddedStore.load_file(Path(embedded_path))
    scheme = urlparse(redis_url).scheme
    factory = _URL_STORES.get(scheme)
    if factory is None:
        raise ValueError(
            f"unknown EAMC store URL scheme {scheme!r} in {redis_url!r}; valid: {sorted(_URL_STORES)}"
        )
    return factory(redis_url)


__all__ = ["Change", "EamcStore", "EmbeddedStore", "open_store"]
