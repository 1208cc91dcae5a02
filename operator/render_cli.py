"""``pdserve render -f llmservice.yaml``: print the child manifests as YAML.

What the operator would create, without a cluster: for review, GitOps, or
``kubectl apply -f -`` where no operator runs. Owner references are left out.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import yaml

from pdserve.operator.render import render
from pdserve.operator.spec import SpecError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-f", "--filename", required=True, help="LLMService YAML file ('-' for stdin)"
    )
    parser.add_argument(
        "-n", "--namespace", default="default", help="namespace when the file has none"
    )


def _documents(stream: TextIO, source: str) -> Iterator[dict[str, Any]]:
    for i, doc in enumerate(yaml.safe_load_all(stream)):
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise SpecError(f"{source}[{i}]", "each YAML document must be an object")
        if doc.get("kind") != "LLMService":
            raise SpecError(f"{source}[{i}].kind", f"expected LLMService, got {doc.get('kind')!r}")
        yield doc


def render_stream(stream: TextIO, source: str, namespace: str) -> list[dict[str, Any]]:
    manifests: list[dict[str, Any]] = []
    for doc in _documents(stream, source):
        manifests.extend(render(doc, namespace))
    return manifests


def run(args: argparse.Namespace) -> int:
    try:
        if args.filename == "-":
            manifests = render_stream(sys.stdin, "<stdin>", args.namespace)
        else:
            with open(args.filename, encoding="utf-8") as f:
                manifests = render_stream(f, args.filename, args.namespace)
    except OSError as e:
        print(f"pdserve render: cannot read {args.filename}: {e.strerror}", file=sys.stderr)
        return 1
    except yaml.YAMLError as e:
        print(f"pdserve render: {args.filename} is not valid YAML: {e}", file=sys.stderr)
        return 1
    except SpecError as e:
        print(f"pdserve render: invalid LLMService: {e}", file=sys.stderr)
        return 1
    if not manifests:
        print(f"pdserve render: no LLMService in {args.filename}", file=sys.stderr)
        return 1
    yaml.safe_dump_all(manifests, sys.stdout, sort_keys=False)
    return 0
