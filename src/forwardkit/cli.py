"""The ``forwardkit`` command: ``forwardkit {config,generate,bench} ...``.

Each subcommand lives in ``forwardkit.commands.<name>`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (called with the parsed
namespace, returning an exit code). Errors print one line and exit non-zero; ``--debug``
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from forwardkit import __version__

# Subcommand name -> module that registers it. Order is the order shown in --help.
SUBCOMMANDS: dict[str, str] = {
    "bench": "forwardkit.commands.bench",
    "config": "forwardkit.commands.config",
    "generate": "forwardkit.commands.generate",
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as one line (exit 2) instead of the usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    """The full parser with every available subcommand registered."""
    parser = _Parser(
        prog="forwardkit",
        description="forwardkit: forward context, compilation config and a reference LLM engine.",
    )
    parser.add_argument("--version", action="version", version=f"forwardkit {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show full tracebacks instead of one-line errors"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for module_name in SUBCOMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # subcommand not shipped in this build
        module.register(subparsers)
    return parser


def _hint(args: argparse.Namespace, exc: Exception) -> str:
    """What to do next, for an error the arguments alone explain: quantizing one of forwardkit's
    own shapes (no ``--model``) whose rows are not whole blocks."""
    from forwardkit.config.model_shapes import BUILTIN_MODEL_SHAPE
    from forwardkit.quantization.formats import BlockShapeError

    if not isinstance(exc, BlockShapeError) or getattr(args, "model", None) is not None:
        return ""
    if not hasattr(args, "model_shape"):  # a command that runs only the built-in model
        return (" (this is the built-in model: to quantize, pass one whose projections are whole "
                "blocks, --model DIR)")
    shape = args.model_shape or BUILTIN_MODEL_SHAPE
    what = "the built-in model" if shape == BUILTIN_MODEL_SHAPE else f"model shape {shape!r}"
    return (f" (this is {what}: to quantize, pass one whose projections are whole blocks, "
            "--model DIR or --model-shape llama-3.2-1b)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``forwardkit`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # --debug is accepted anywhere on the line (before or after the subcommand).
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    args = parser.parse_args(argv)
    args.debug = debug
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("forwardkit: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one clear line unless --debug
        if args.debug:
            raise
        text = str(exc).strip().splitlines()
        first = text[0] if text else type(exc).__name__
        first += _hint(args, exc)
        print(f"forwardkit {args.command}: error: {first}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
