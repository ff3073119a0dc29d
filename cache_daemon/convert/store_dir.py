"""The store directory of a conversion: what is already there, the partial copy, the publish.

A conversion writes into ``DST.partial`` and renames it onto ``DST`` at the end (the previous
store moved aside to ``DST.replaced`` meanwhile), so an interrupted run never leaves a store that
looks complete; ``remove_stale`` clears what such a run left before the next one starts.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from expertcache.errors import DataLoss, FailedPrecondition
from expertcache.manifest import MANIFEST_NAME, StoreManifest, read_manifest

logger = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"  # the previous store, moved aside while --force replaces it


def partial_dir(dst: Path) -> Path:
    return dst.with_name(dst.name + PARTIAL_SUFFIX)


def existing_store(dst: Path, force: bool) -> StoreManifest | None:
    """The manifest of the store at ``dst``, None if there is none; refuse to clobber other data."""
    if not dst.exists():
        return None
    if not dst.is_dir():
        raise FailedPrecondition(f"destination {dst} exists and is not a directory")
    if (dst / MANIFEST_NAME).is_file():
        if force:
            return None
        try:
            return read_manifest(dst)
        except DataLoss as exc:
            raise FailedPrecondition(f"{exc}; pass --force to replace the store at {dst}") from exc
    if any(dst.iterdir()) and not force:
        raise FailedPrecondition(
            f"destination {dst} exists, is not empty and holds no expert store; pass --force to replace it"
        )
    return None


def publish(partial: Path, dst: Path) -> None:
    """Atomically put the finished ``partial`` directory in place of ``dst``."""
    aside = dst.with_name(dst.name + REPLACED_SUFFIX)
    if aside.exists():
        shutil.rmtree(aside)
    if dst.exists():
        os.replace(dst, aside)  # replace() cannot overwrite a non-empty directory
    os.replace(partial, dst)
    sync_dir(dst.parent)
    if aside.exists():
        shutil.rmtree(aside)


def sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale(dst: Path) -> None:
    for stale in (partial_dir(dst), dst.with_name(dst.name + REPLACED_SUFFIX)):
        if stale.exists():
            logger.warning("removing %s left by an interrupted conversion", stale)
            shutil.rmtree(stale)
