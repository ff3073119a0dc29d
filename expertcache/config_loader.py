"""Loading one frozen, validated config per service.

Precedence: CLI > environment > config file (the ConfigMap, YAML) > field default. Each config
is a frozen dataclass whose fields carry ``metadata={"help": ..., "min": ..., "max": ...,
"choices": [...]}``; ``load_config`` checks every value against it and raises
``InvalidArgument`` naming the field, its source and the allowed range.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from expertcache.errors import InvalidArgument

T = TypeVar("T")


def _convert(cls, field: dataclasses.Field, value: Any, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    typ = hints[field.name]
    origin = typing.get_origin(typ)
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and args:
        if value is None or value == "":
            return None
        typ = args[0]
    try:
        if typ is bool:
            if isinstance(value, str):
                low = value.strip().lower()
                if low in ("1", "true", "yes", "on"):
                    return True
                if low in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if typ in (int, float, str):
            return typ(value)
        if typing.get_origin(typ) is tuple:
            if isinstance(value, str):
                value = [v for v in value.split(",") if v]
            return tuple(value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(
            f"config field {field.name!r} from {source}: cannot read {value!r} as {typ}"
        ) from exc
    return value


def validate(config: Any) -> None:
    """Check every field of ``config`` against its metadata constraints."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        meta = field.metadata
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            # NaN compares false with every bound, so it would pass the range checks below.
            raise InvalidArgument(f"config field {field.name!r} = {value!r} is not a finite number")
        if "min" in meta and value < meta["min"]:
            raise InvalidArgument(
                f"config field {field.name!r} = {value!r} is below its minimum {meta['min']!r}"
            )
        if "max" in meta and value > meta["max"]:
            raise InvalidArgument(
                f"config field {field.name!r} = {value!r} is above its maximum {meta['max']!r}"
            )
        if "choices" in meta and value not in meta["choices"]:
            raise InvalidArgument(
                f"config field {field.name!r} = {value!r} is not one of {', '.join(map(str, meta['choices']))}"
            )
    check = getattr(config, "check", None)
    if callable(check):
        check()


def load_config(
    cls: type[T],
    *,
    cli: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    env_prefix: str = "",
    file: str | Path | None = None,
) -> T:
    """Build ``cls`` from defaults < file < env (``PREFIX_FIELD``) < cli, then validate."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    names = {f.name: f for f in dataclasses.fields(cls)}
    if file is not None:
        path = Path(file)
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise InvalidArgument(f"config file {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise InvalidArgument(f"config file {path} must hold a mapping of field names to values")
        for key, value in raw.items():
            name = str(key).replace("-", "_")
            if name not in names:
                raise InvalidArgument(
                    f"config file {path}: unknown field {key!r}; known fields: {', '.join(sorted(names))}"
                )
            values[name] = value
            sources[name] = f"file {path}"
    environ = os.environ if env is None else env
    for name in names:
        var = f"{env_prefix}{name.upper()}"
        if var in environ:
            values[name] = environ[var]
            sources[name] = f"env {var}"
    for name, value in (cli or {}).items():
        if value is not None:
            if name not in names:
                raise InvalidArgument(f"unknown config field {name!r}")
            values[name] = value
            sources[name] = "command line"
    converted = {n: _convert(cls, names[n], v, sources[n]) for n, v in values.items()}
    config = cls(**converted)
    validate(config)
    return config


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One ``--field-name`` option per config field (all default to None = not given)."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        flag = "--" + field.name.replace("_", "-")
        help_text = field.metadata.get("help", "")
        default = field.default if field.default is not dataclasses.MISSING else None
        if hints[field.name] is bool:
            parser.add_argument(
                flag, dest=field.name, default=None, action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            parser.add_argument(flag, dest=field.name, default=None, help=f"{help_text} (default: {default})")


def cli_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    return {f.name: getattr(args, f.name, None) for f in dataclasses.fields(cls)}
