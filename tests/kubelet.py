"""A ConfigMap volume as the kubelet writes it, for the live-config tests: edits are published by
swapping a symlink, never by writing the file in place."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


class KubeletVolume:
    """A directory laid out like a ConfigMap volume: ``<key>`` -> ``..data/<key>``, ``..data`` ->
    ``..<timestamp>``; ``write`` publishes new content atomically as the kubelet does."""

    def __init__(self, root: Path, key: str, text: str) -> None:
        self.root, self.key = root, key
        root.mkdir(parents=True)
        self._generation = 0
        self._current = self._new_dir(text)
        os.symlink(self._current.name, root / "..data")
        os.symlink(f"..data/{key}", root / key)

    @property
    def path(self) -> Path:
        return self.root / self.key

    def _new_dir(self, text: str) -> Path:
        self._generation += 1
        d = self.root / f"..2026_11_25_00_00_{self._generation:02d}.{os.getpid()}"
        d.mkdir()
        (d / self.key).write_text(text)
        return d

    def write(self, text: str) -> None:
        new = self._new_dir(text)
        os.symlink(new.name, self.root / "..data_tmp")
        os.rename(self.root / "..data_tmp", self.root / "..data")  # the atomic swap
        shutil.rmtree(self._current)
        self._current = new
