"""The ``pdserve`` command: one entry point, one subcommand per component.

Each subcommand lives in the module that owns it; that module exposes ``run(args) -> int``
and its flags: ``FLAGS``, the args dataclasses its parser is generated from
(pdserve/config_cli.py), or else ``add_arguments(parser)``. Modules are imported only
when their subcommand runs, so ``pdserve render`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from pdserve import config_cli

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "tiny-model": ("pdserve.engine.tiny_model", "write a small random Llama-style model"),
    "generate": ("pdserve.engine.generate_cli", "generate text with the engine in-process"),
    "prefill-worker": ("pdserve.prefill_worker.main", "run a prefill worker"),
    "decode-worker": ("pdserve.decode_worker.main", "run a decode worker"),
    "router": ("pdserve.router.main", "run the OpenAI-compatible router"),
    "up": ("pdserve.local.up", "run router + workers locally"),
    "operator": ("pdserve.operator.main", "run the Kubernetes operator"),
    "render": ("pdserve.operator.render_cli", "render an LLMService to manifests"),
    "crds": ("pdserve.operator.crds_cli", "server-side apply pdserve's CRDs (upgrades)"),
    "rotate-secret": ("pdserve.operator.rotate_secret", "a new service secret, no failed call"),
    "profile": ("pdserve.planner.profile", "measure per-replica capacities"),
}

# The install extra (pyproject.toml) each command needs; the rest need pdserve[all].
EXTRA_OF = {
    "router": "router",
    "prefill-worker": "worker",
    "decode-worker": "worker",
    "generate": "worker",
    "tiny-model": "worker",
    "operator": "operator",
    "render": "operator",
    "crds": "operator",
    "rotate-secret": "operator",
}


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text)
    return parser, sub


def command_parser_of(name: str, module: ModuleType) -> argparse.ArgumentParser:
    """A command's parser: from its args dataclasses (``FLAGS``: pdserve/config_cli.py, with
    ``--help`` short and ``--help-all``), else the module's own ``add_arguments``."""
    prog, description = f"pdserve {name}", SUBCOMMANDS[name][1]
    flags = getattr(module, "FLAGS", None)
    if flags is not None:
        return config_cli.build_parser(prog, description, flags)
    parser = argparse.ArgumentParser(prog=prog, description=description)
    module.add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, _ = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        parser.parse_args(argv)  # prints usage / error for unknown commands
        parser.print_help()
        return 2
    name = argv[0]
    from pdserve.local.parent_watch import watch_from_env

    watch_from_env()  # started by `pdserve up`: end with it (local/parent_watch.py)
    try:
        module = importlib.import_module(SUBCOMMANDS[name][0])
        command_parser = command_parser_of(name, module)
        args = command_parser.parse_args(argv[1:])
        return int(module.run(args) or 0)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing in ("", "pdserve"):
            raise
        extra = EXTRA_OF.get(name, "all")
        raise SystemExit(
            f"pdserve {name}: this install has no {missing!r}, which it needs: "
            f"pip install 'pdserve[{extra}]' (docs/images.md)"
        ) from exc


if __name__ == "__main__":
    sys.exit(main())
