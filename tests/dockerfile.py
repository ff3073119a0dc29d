"""The project's Dockerfile read without a Docker engine: its logical lines, its stages (global
ARG defaults applied to FROM), what a target inherits, its entry command."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field


@dataclass
class Stage:
    name: str
    base: str  # the FROM image or the name of an earlier stage
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)


def logical_lines(text: str) -> list[str]:
    """Instructions with their continuation lines joined, comments and blank lines dropped."""
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    if current:
        lines.append(current)
    return lines


def parse_stages(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARG defaults, and the stages by name."""
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in logical_lines(text):
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            match = re.match(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?$", rest.strip(), re.IGNORECASE)
            assert match, f"cannot read FROM {rest!r}"
            base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], m[0]), match[1])
            name = match[2] or f"stage{len(stages)}"
            current = stages[name] = Stage(name, base)
        elif current is None:
            if instruction == "ARG":
                key, _, value = rest.partition("=")
                args[key.strip()] = value.strip().strip('"')
        else:
            current.instructions.append((instruction, rest.strip()))
    return args, stages


def chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it builds on, nearest first."""
    out = []
    while name in stages:
        out.append(stages[name])
        name = stages[name].base
    return out


def base_image(stages: dict[str, Stage], name: str) -> str:
    return chain(stages, name)[-1].base


def last(stages: dict[str, Stage], name: str, instruction: str) -> str | None:
    for stage in chain(stages, name):
        for found, rest in reversed(stage.instructions):
            if found == instruction:
                return rest
    return None


def entry_command(stages: dict[str, Stage], name: str) -> list[str]:
    """The target's ENTRYPOINT (else CMD) in exec form; AssertionError naming the problem."""
    raw = last(stages, name, "ENTRYPOINT") or last(stages, name, "CMD")
    assert raw, f"target {name!r} has no ENTRYPOINT or CMD"
    try:
        command = json.loads(raw)
    except json.JSONDecodeError:
        raise AssertionError(f"target {name!r}: entry command {raw!r} is not in exec form") from None
    assert isinstance(command, list) and command, f"target {name!r}: empty entry command"
    return command
