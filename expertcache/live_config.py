"""Live configuration: watch the mounted config file (a ConfigMap volume) and reload on change.

::

    kubelet swaps <dir>/..data ──► watchfiles (inotify on <dir>) ─┐
    SIGHUP ──────────────────────────────────────────────────────┼─► LiveReloader.trigger()
    ConfigMap watch (expertcache.k8s_watch) ──────────────────────┘        │
                                                        reload thread: load + validate whole,
                                                        apply live keys, warn on restart-only

A ConfigMap volume updates its files by writing a new timestamped directory and renaming the
``..data`` symlink over the old one, so the file's own inode never changes in place: the
directory is watched, not the file. Each trigger wakes one reload thread (a reload never runs in
a signal handler or a watcher's thread), which reads the file and skips it when its bytes did
not change (a SIGHUP always reloads).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import watchfiles
import yaml

from expertcache.config_loader import env_name, load_config
from expertcache.errors import ExpertCacheError

logger = logging.getLogger(__name__)


class LiveReloader:
    """One thread that runs ``reload(origin)`` whenever it is triggered.

    ``reload`` loads and applies the config; it handles (and logs) its own errors. ``origin``
    is what triggered it ("SIGHUP", "file <path>", "ConfigMap ns/name"), or a callable
    returning the data to apply (the Kubernetes watch hands the ConfigMap's content over)."""

    def __init__(self, reload: Callable[[str, object], None]) -> None:
        self._reload = reload
        self._cond = threading.Condition()
        self._pending: list[tuple[str, object]] = []
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="config-reload", daemon=True)
        self._thread.start()

    def trigger(self, origin: str, data: object = None) -> None:
        """Ask for a reload (safe from a signal handler: it only appends and notifies)."""
        with self._cond:
            self._pending.append((origin, data))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                batch, self._pending = self._pending, []
            for origin, data in batch:
                try:
                    self._reload(origin, data)
                except Exception:  # a reload must never end the thread
                    logger.exception("config reload from %s failed", origin)

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(5.0)


class ConfigFileWatcher:
    """Watches the directory of ``path`` (watchfiles: inotify; polling only when inotify fails)
    and calls ``on_change()`` when the bytes of ``path`` (through symlinks) change.

    Only entries that can change the config wake it: ``path`` itself, the names its symlinks go
    through in that directory, and the kubelet's ``..``-prefixed ones (``..data``, ``..data_tmp``,
    the timestamped directories). Anything else there (a log written next to the config, an
    editor's swap file) is ignored: a busy log would otherwise re-read the config at every write.
    """

    def __init__(self, path: str | Path, on_change: Callable[[], None]) -> None:
        self.path = Path(path)
        self._on_change = on_change
        self._stop = threading.Event()
        self._last = self._read()
        self._thread = threading.Thread(target=self._run, name="config-file-watch", daemon=True)
        self._thread.start()

    def _read(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except OSError:
            return None

    def _config_names(self) -> set[str]:
        """The names in the watched directory that ``path`` is, or resolves through."""
        names = {self.path.name}
        link = self.path
        for _ in range(8):  # a chain of symlinks inside the directory (a loop ends here too)
            try:
                target = Path(os.readlink(link))
            except OSError:
                break
            if target.is_absolute() or not target.parts:
                break
            names.add(target.parts[0])
            link = self.path.parent / target.parts[0]
        return names

    def _concerns(self, _change: watchfiles.Change, changed: str) -> bool:
        name = Path(changed).name
        return name.startswith("..") or name in self._config_names()

    def _run(self) -> None:
        directory = self.path.parent
        # inotify first; polling only where it cannot be had (no inotify, the watch limit
        # reached, a filesystem without events), so that an edit is still noticed.
        for polling in (False, True):
            try:
                self._watch(directory, polling)
                return
            except Exception as exc:  # noqa: BLE001 - fall back, then give up to SIGHUP alone
                if self._stop.is_set():
                    return
                if polling:
                    logger.error("cannot watch %s (%s); only SIGHUP reloads the config", directory, exc)
                else:
                    logger.warning(
                        "cannot watch %s with inotify (%s); polling it every second", directory, exc
                    )

    def _watch(self, directory: Path, polling: bool) -> None:
        for _changes in watchfiles.watch(
            directory,
            watch_filter=self._concerns,
            stop_event=self._stop,
            recursive=False,
            debounce=200,
            step=50,
            force_polling=True if polling else None,
            poll_delay_ms=1000,
            raise_interrupt=False,
        ):
            content = self._read()
            if content is None or content == self._last:
                continue  # the same bytes (a kubelet resync), or mid-swap: the next event tells
            self._last = content
            logger.info("config file %s changed", self.path)
            self._on_change()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)


def live_changes(cls: type, old: object, new: object, origin: str) -> dict[str, object]:
    """The live fields (``metadata["live"]``) that differ between ``old`` and ``new``; a changed
    restart-only field is logged as a warning naming it and left out."""
    changes: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        before, after = getattr(old, f.name), getattr(new, f.name)
        if before == after:
            continue
        if f.metadata.get("live"):
            changes[f.name] = after
        else:
            logger.warning(
                "config field %r changed in %s (%r -> %r) but applies only at start: not applied "
                "until the service restarts",
                f.name,
                origin,
                before,
                after,
            )
    return changes


class LiveConfig:
    """Everything that reloads one service's config while it runs.

    ``apply(fresh, origin)`` adopts the live fields of ``fresh`` (validated whole already) and
    raises ``ExpertCacheError`` to refuse it; a refusal keeps the running config, logs an ERROR
    naming the origin and the reason, and posts a Warning Event on the ConfigMap when it is
    watched through the Kubernetes API."""

    def __init__(
        self,
        cls: type,
        *,
        cli: dict[str, object],
        env_prefix: str,
        config_file: str | None,
        apply: Callable[[object, str], None],
        config_map_name: str = "",
        config_map_key: str = "",
        service: str = "",
    ) -> None:
        self._cls = cls
        self._cli = cli
        self._env_prefix = env_prefix
        self._config_file = config_file
        self._apply = apply
        self._overridden: set[tuple[str, str]] = set()
        self._reloader = LiveReloader(self._reload)
        self._file_watcher = (
            ConfigFileWatcher(config_file, lambda: self._reloader.trigger(f"file {config_file}"))
            if config_file
            else None
        )
        self.config_map = None
        if config_map_name:
            from expertcache.k8s_watch import ConfigMapWatcher  # the kubernetes client loads only when used

            self.config_map = ConfigMapWatcher(
                config_map_name,
                config_map_key,
                on_data=self._reloader.trigger,
                component=service,
            )

    def trigger(self, origin: str) -> None:
        """Reload from the config file (SIGHUP); safe from a signal handler."""
        self._reloader.trigger(origin)

    def _reload(self, origin: str, data: object) -> None:
        try:
            if data is not None:
                fresh = load_config(
                    self._cls, cli=self._cli, env_prefix=self._env_prefix, file_data=(data, origin)
                )
            else:
                fresh = load_config(
                    self._cls, cli=self._cli, env_prefix=self._env_prefix, file=self._config_file
                )
            self._warn_overridden(origin, data)
            self._apply(fresh, origin)
        except ExpertCacheError as exc:
            logger.error("config change from %s refused, the running config stays: %s", origin, exc)
            if self.config_map is not None:
                self.config_map.post_warning(f"config change from {origin} refused: {exc}")

    def _warn_overridden(self, origin: str, data: object) -> None:
        """A key set in the file but also on the command line or in the environment is not
        applied (CLI > env > file): say so once per key and value, or an edit looks ignored."""
        try:
            if data is not None:
                raw = yaml.safe_load(str(data)) or {}
            elif self._config_file:
                raw = yaml.safe_load(Path(self._config_file).read_text(encoding="utf-8")) or {}
            else:
                return
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            return  # changed again meanwhile: the next reload tells
        for key, value in raw.items() if isinstance(raw, dict) else ():
            name = str(key).replace("-", "_")
            var = env_name(self._env_prefix, name)
            where = "the command line" if self._cli.get(name) is not None else None
            if where is None and var in os.environ:
                where = f"env {var}"
            if where is not None and (name, repr(value)) not in self._overridden:
                self._overridden.add((name, repr(value)))
                logger.warning(
                    "config key %r = %r in %s is not applied: %s sets it, and wins over the file",
                    name,
                    value,
                    origin,
                    where,
                )

    def close(self) -> None:
        if self.config_map is not None:
            self.config_map.close()
        if self._file_watcher is not None:
            self._file_watcher.close()
        self._reloader.close()
