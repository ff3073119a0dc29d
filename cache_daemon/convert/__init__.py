"""Checkpoint → expert store conversion (``python -m cache_daemon.convert SRC DST``)."""

from cache_daemon.convert.converter import ConversionResult, convert, run_conversion
from cache_daemon.convert.sources import SUPPORTED_MODEL_TYPES

__all__ = ["SUPPORTED_MODEL_TYPES", "ConversionResult", "convert", "run_conversion"]
