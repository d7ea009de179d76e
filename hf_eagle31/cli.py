"""The `hf-eagle31` command. Each subcommand lives in its own module, imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing `configure_parser(parser)` and `run(args) -> int | None`
SUBCOMMANDS: dict[str, str] = {
    "distill": "hf_eagle31.training.distill",
    "train": "hf_eagle31.training.command",
    "card": "hf_eagle31.model_cards.card",
    "bench": "hf_eagle31.bench.command",
    "plan": "hf_eagle31.planner",
    "convert": "hf_eagle31.conversion.convert",
}


class Parser(argparse.ArgumentParser):
    """Usage errors in one line with exit code 2, like every other bad input (argparse prints the whole usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="hf-eagle31", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        module.configure_parser(sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0]))
    args = parser.parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command])
    try:
        return int(module.run(args) or 0)
    except (ValueError, OSError) as err:  # bad input, or a model transformers cannot load: one line, no stack trace
        print(f"hf-eagle31 {args.command}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
