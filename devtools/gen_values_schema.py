"""Write the chart's schema of ``daemon.config``, ``predictor.config`` and ``compute.config``
(helm/expertcache/values.schema.json) from each service's ``--print-config-schema``.

Those values become the services' config files in the ConfigMap (daemon.yaml, predictor.yaml,
compute.yaml). With their keys in the chart's schema, ``helm template`` / ``helm install``
refuses an unknown key or a value out of its range before anything is deployed, instead of the
pod failing at start. The services' config classes are the one source: this script copies each
field's type, bounds, choices, default and help, and the rest of values.schema.json stays as
written by hand.

    python -m devtools.gen_values_schema          # rewrite the file (make values-schema)
    python -m devtools.gen_values_schema --check  # exit 1 when the committed file differs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "helm" / "expertcache" / "values.schema.json"
MAKE_TARGET = "make values-schema"
# The chart's values key → the service's package (python -m <package> --print-config-schema).
SERVICES = {"daemon": "cache_daemon", "predictor": "predictor_svc", "compute": "compute_svc"}
# What a chart schema keeps of a property; the rest (title, x-env, x-flag, x-live) is for the
# services' own tooling.
KEPT = ("type", "enum", "minimum", "maximum", "items", "anyOf", "default", "description")


def print_config_schema(package: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", package, "--print-config-schema"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


def chart_property(prop: dict[str, Any]) -> dict[str, Any]:
    """One config field as the chart's schema checks it: what the service's loader accepts from
    a YAML file."""
    out = {k: prop[k] for k in KEPT if k in prop}
    if "anyOf" in out:
        out["anyOf"] = [chart_property(p) for p in out["anyOf"]]
    if prop.get("x-upper") and "enum" in out:
        # The loader upper-cases these before the check ("info" is INFO).
        out["pattern"] = "^(?i:" + "|".join(out.pop("enum")) + ")$"
    if out.get("type") == "array":
        # The loader also reads "a,b" as a list (as from an environment variable).
        array = {k: out.pop(k) for k in ("type", "items") if k in out}
        out["anyOf"] = [array, {"type": "string"}]
    return out


def config_values_schema(key: str, package: str) -> dict[str, Any]:
    schema = print_config_schema(package)
    return {
        "type": "object",
        "description": f"Keys of {key}.yaml in the ConfigMap: the fields of {schema['title']} "
        f"(generated from `python -m {package} --print-config-schema` by {MAKE_TARGET}).",
        "properties": {name: chart_property(p) for name, p in sorted(schema["properties"].items())},
        "additionalProperties": False,
    }


def generate(values_schema: dict[str, Any]) -> dict[str, Any]:
    """``values_schema`` with its three ``config`` schemas generated anew."""
    out = json.loads(json.dumps(values_schema))
    for key, package in SERVICES.items():
        out["properties"][key]["properties"]["config"] = config_values_schema(key, package)
    return out


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="only compare: exit 1 when the committed schema differs"
    )
    args = parser.parse_args(argv)
    committed = SCHEMA.read_text(encoding="utf-8")
    fresh = render(generate(json.loads(committed)))
    if args.check:
        if fresh != committed:
            print(
                f"{SCHEMA.relative_to(REPO)} differs from the services' --print-config-schema: "
                f"run `{MAKE_TARGET}` and commit it",
                file=sys.stderr,
            )
            return 1
        return 0
    if fresh != committed:
        SCHEMA.write_text(fresh, encoding="utf-8")
        print(f"wrote {SCHEMA.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
