"""EAMC stores: where each model's EAM collection lives. ``open_store`` picks one.

No Redis URL → the embedded store (optionally loaded from / saved to a file); a URL → Redis,
chosen by URL scheme from a table of openers (unknown schemes raise ValueError listing the valid ones).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from expertcache.security import read_secret, redact_url
from predictor_svc.store.base import Change, EamcStore
from predictor_svc.store.embedded import DEFAULT_LOG_LEN as DEFAULT_EMBEDDED_LOG_LEN
from predictor_svc.store.embedded import EmbeddedStore


@dataclass(frozen=True)
class RedisOptions:
    """Redis credentials kept out of the URL (config fields ``redis_username``,
    ``redis_password_file``, ``redis_tls_ca_file``; the files come from a mounted Secret)."""

    username: str = ""
    password_file: str = ""
    tls_ca_file: str = ""

    @classmethod
    def from_config(cls, config: Any) -> RedisOptions:
        return cls(
            getattr(config, "redis_username", "") or "",
            getattr(config, "redis_password_file", "") or "",
            getattr(config, "redis_tls_ca_file", "") or "",
        )


def _open_redis(url: str, options: RedisOptions, log_len: int | None) -> EamcStore:
    from predictor_svc.store.redis_store import DEFAULT_LOG_LEN, RedisStore  # noqa: PLC0415 - only with a URL

    password = read_secret(options.password_file, "redis_password_file") if options.password_file else None
    return RedisStore(
        url,
        log_len or DEFAULT_LOG_LEN,
        username=options.username or None,
        password=password,
        tls_ca_file=options.tls_ca_file or None,
    )


# URL scheme -> factory. redis-py understands all three.
_URL_STORES: dict[str, Callable[[str, RedisOptions, int | None], EamcStore]] = {
    "redis": _open_redis,
    "rediss": _open_redis,
    "unix": _open_redis,
}


def open_store(
    redis_url: str | None,
    embedded_path: Path | None = None,
    log_len: int | None = None,
    *,
    redis: RedisOptions | None = None,
) -> EamcStore:
    """The store for this configuration: Redis at ``redis_url``, else the embedded store.

    The embedded store is loaded from ``embedded_path`` when the file exists and saved there on
    ``close()``; without a path it lives in memory only. ``log_len``: change-log records kept per
    model (each carries a blob, so it bounds the log's memory; default the store's). ``redis``
    holds the credentials.
    """
    if not redis_url:
        if embedded_path is None:
            return EmbeddedStore(log_len=log_len or DEFAULT_EMBEDDED_LOG_LEN)
        return EmbeddedStore.load_file(Path(embedded_path), log_len or DEFAULT_EMBEDDED_LOG_LEN)
    scheme = urlparse(redis_url).scheme
    factory = _URL_STORES.get(scheme)
    if factory is None:
        raise ValueError(
            f"unknown EAMC store URL scheme {scheme!r} in {redact_url(redis_url)!r}; valid: {sorted(_URL_STORES)}"
        )
    return factory(redis_url, redis or RedisOptions(), log_len)


__all__ = ["Change", "EamcStore", "EmbeddedStore", "RedisOptions", "open_store"]
