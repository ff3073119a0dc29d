"""Loading one frozen, validated config per service, and its JSON Schema.

Precedence: CLI > environment > config file (the ConfigMap, YAML) > field default. Each config
is a frozen dataclass whose fields carry ``metadata={"help": ..., "min": ..., "max": ...,
"choices": [...], "live": bool, "upper": bool}``. From those, ``schema_model`` builds one
pydantic model per service: it is the single validator of every value, wherever it comes from
(command line, environment, file, a live reload, the daemon's UpdateConfig RPC), and the source
of ``--print-config-schema`` (JSON Schema whose properties carry ``x-live``, ``x-env`` and
``x-flag``, and ``x-upper`` where any case is accepted; the chart's ``values.schema.json`` is
generated from it by ``devtools/gen_values_schema.py``). ``load_config`` raises ``InvalidArgument``
naming the field, its source and the allowed range; NaN and infinity are refused for every float.

pydantic-settings was considered: its sources would replace this module's merge, but it neither
reports which source a bad value came from nor reloads a file on demand, both of which the live
reload needs, so the merge stays here and pydantic only validates.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import pydantic
import yaml

from expertcache.errors import InvalidArgument

T = TypeVar("T")

_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean (true/false)", str: "a string"}


def live_fields(cls: type) -> tuple[str, ...]:
    """The fields of ``cls`` applied without a restart (``metadata["live"]``)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("live"))


def env_name(env_prefix: str, name: str) -> str:
    return f"{env_prefix}{name.upper()}"


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(typ: Any) -> tuple[Any, bool]:
    """(the type without ``None``, whether None is allowed)."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return typ, False


def allowed_range(field: dataclasses.Field, typ: Any) -> str:
    """What a field accepts, in words: its type, bounds and choices."""
    meta = field.metadata
    base, optional = _base_type(typ)
    if "choices" in meta:
        text = "one of " + ", ".join(map(str, meta["choices"]))
    else:
        text = _TYPE_NAMES.get(base, str(base))
        if base is float:
            text = "a finite number"
        lo, hi = meta.get("min"), meta.get("max")
        if lo is not None and hi is not None:
            text += f" in [{lo}, {hi}]"
        elif lo is not None:
            text += f" >= {lo}"
        elif hi is not None:
            text += f" <= {hi}"
    return text + (" or empty" if optional else "")


@functools.cache
def schema_model(cls: type, env_prefix: str = "") -> type[pydantic.BaseModel]:
    """The pydantic model validating ``cls``'s fields (types, bounds, choices, finite floats)."""
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata
        typ = hints[f.name]
        base, optional = _base_type(typ)
        if "choices" in meta:
            typ = Literal[tuple(meta["choices"])]
            if optional:
                typ = typ | None
        constraints: dict[str, Any] = {}
        if "min" in meta:
            constraints["ge"] = meta["min"]
        if "max" in meta:
            constraints["le"] = meta["max"]
        if base is float:
            constraints["allow_inf_nan"] = False
        if constraints:
            inner = typing.Annotated[base, pydantic.Field(**constraints)]
            typ = inner | None if optional else inner
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = ...
        extra = {
            "x-live": bool(meta.get("live")),
            "x-env": env_name(env_prefix, f.name),
            "x-flag": flag_name(f.name),
        }
        if meta.get("upper"):
            extra["x-upper"] = True  # upper-cased before the check: any case is accepted
        fields[f.name] = (
            typ,
            pydantic.Field(default, description=meta.get("help", ""), json_schema_extra=extra),
        )
    return pydantic.create_model(
        cls.__name__,
        __config__=pydantic.ConfigDict(extra="forbid", coerce_numbers_to_str=True, title=cls.__name__),
        **fields,
    )


def config_schema(cls: type, env_prefix: str = "") -> dict[str, Any]:
    """JSON Schema of ``cls``: each property has ``x-live``, ``x-env`` and ``x-flag``."""
    schema = schema_model(cls, env_prefix).model_json_schema()
    schema["description"] = (cls.__doc__ or "").strip()
    return schema


def print_config_schema(cls: type, env_prefix: str = "") -> None:
    print(json.dumps(config_schema(cls, env_prefix), indent=2, sort_keys=True))


def _shown(value: Any, base: Any) -> Any:
    """``value`` as the field's type where it reads as one ("-1" → -1), for messages."""
    if isinstance(value, str) and base in (int, float):
        try:
            return base(value)
        except ValueError:
            return value
    return value


def _message(cls: type, error: dict[str, Any], sources: dict[str, str]) -> str:
    name = str(error["loc"][0]) if error["loc"] else "?"
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if name not in fields:
        return f"unknown config field {name!r}; known fields: {', '.join(sorted(fields))}"
    field = fields[name]
    base, _ = _base_type(typing.get_type_hints(cls)[name])
    source = sources.get(name, "the defaults")
    value = error.get("input")
    shown = _shown(value, base)
    allowed = allowed_range(field, typing.get_type_hints(cls)[name])
    kind = error["type"]
    if kind in ("greater_than_equal", "greater_than"):
        return f"config field {name!r} = {shown!r} is below its minimum {field.metadata['min']!r} (from {source}; allowed: {allowed})"
    if kind in ("less_than_equal", "less_than"):
        return f"config field {name!r} = {shown!r} is above its maximum {field.metadata['max']!r} (from {source}; allowed: {allowed})"
    if kind == "literal_error":
        return f"config field {name!r} = {value!r} is not one of {', '.join(map(str, field.metadata['choices']))} (from {source})"
    if kind == "finite_number":
        return f"config field {name!r} = {value!r} from {source} is not a finite number (allowed: {allowed})"
    return f"config field {name!r} from {source}: cannot read {value!r} as {allowed} ({error['msg']})"


def _prepare(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """Spellings the loader accepts beyond pydantic's: "" for None, "a,b" for a tuple, any case
    for an upper-case choice."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = {}
    for name, value in values.items():
        if name not in fields:
            out[name] = value
            continue
        base, optional = _base_type(hints[name])
        if optional and value == "":
            value = None
        elif typing.get_origin(base) is tuple and isinstance(value, str):
            value = tuple(v for v in value.split(",") if v)
        elif typing.get_origin(base) is tuple and isinstance(value, list):
            value = tuple(value)
        if fields[name].metadata.get("upper") and isinstance(value, str):
            value = value.upper()
        out[name] = value
    return out


def validate_values(cls: type[T], values: dict[str, Any], sources: dict[str, str] | None = None) -> T:
    """Build ``cls`` from ``values`` (defaults for the rest), validated field by field and then
    by ``cls.check``; ``InvalidArgument`` naming every bad field, its source and allowed range."""
    sources = sources or {}
    model = schema_model(cls)
    try:
        checked = model.model_validate(_prepare(cls, values))
    except pydantic.ValidationError as exc:
        raise InvalidArgument("; ".join(_message(cls, e, sources) for e in exc.errors())) from None
    config = cls(**{f.name: getattr(checked, f.name) for f in dataclasses.fields(cls)})
    check = getattr(config, "check", None)
    if callable(check):
        check()
    return config


def validate(config: Any, source: str = "the running config") -> None:
    """Check every field of the dataclass instance ``config`` (e.g. after ``dataclasses.replace``)."""
    cls = type(config)
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(cls)}
    validate_values(cls, values, dict.fromkeys(values, source))


def read_config_file(cls: type, file: str | Path) -> dict[str, Any]:
    """The field values a YAML config file sets; ``InvalidArgument`` naming the file and key."""
    path = Path(file)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise InvalidArgument(
            f"config file {path} is not UTF-8 text: byte 0x{exc.object[exc.start]:02x} at offset {exc.start}"
        ) from None
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidArgument(f"config file {path}: {exc}") from exc
    return file_values(cls, raw, str(path))


def file_values(cls: type, raw: Any, origin: str) -> dict[str, Any]:
    """Field values of a parsed YAML mapping ``raw`` (from ``origin``, for messages)."""
    names = {f.name for f in dataclasses.fields(cls)}
    if not isinstance(raw, dict):
        raise InvalidArgument(f"config file {origin} must hold a mapping of field names to values")
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in names:
            raise InvalidArgument(
                f"config file {origin}: unknown field {key!r}; known fields: {', '.join(sorted(names))}"
            )
        values[name] = value
    return values


def load_config(
    cls: type[T],
    *,
    cli: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    env_prefix: str = "",
    file: str | Path | None = None,
    file_data: tuple[str, str] | None = None,
) -> T:
    """Build ``cls`` from defaults < file < env (``PREFIX_FIELD``) < cli, then validate.

    ``file_data``: the YAML text of a config file and where it came from (a ConfigMap key read
    through the Kubernetes API), used instead of ``file``."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    if file_data is not None:
        text, origin = file_data
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise InvalidArgument(f"{origin}: {exc}") from exc
        for name, value in file_values(cls, raw, origin).items():
            values[name] = value
            sources[name] = origin
    elif file is not None:
        for name, value in read_config_file(cls, file).items():
            values[name] = value
            sources[name] = f"file {file}"
    environ = os.environ if env is None else env
    for name in names:
        var = env_name(env_prefix, name)
        if var in environ:
            values[name] = environ[var]
            sources[name] = f"env {var}"
    for name, value in (cli or {}).items():
        if value is not None:
            if name not in names:
                raise InvalidArgument(f"unknown config field {name!r}")
            values[name] = value
            sources[name] = "command line"
    return validate_values(cls, values, sources)


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One ``--field-name`` option per config field (all default to None = not given), and
    ``--print-config-schema``."""
    hints = typing.get_type_hints(cls)
    parser.add_argument(
        "--print-config-schema",
        action="store_true",
        help="Print the JSON Schema of the config (x-live: applied without restart, x-env, x-flag) and exit.",
    )
    for field in dataclasses.fields(cls):
        flag = flag_name(field.name)
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
