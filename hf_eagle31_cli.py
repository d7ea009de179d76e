"""The `hf-eagle31` command: train, benchmark, convert and describe EAGLE-3 / EAGLE 3.1 drafters.

It lives outside the `hf_eagle31` package because importing that package imports torch and
transformers (seconds): `hf-eagle31 --help` reads the static table below, and only the chosen
subcommand's module is imported. `python -m hf_eagle31.cli` runs the same command.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

# subcommand -> (module exposing `configure_parser(parser)` and `run(args) -> int | None`, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "distill": ("hf_eagle31.commands.distill", "have the target answer chat prompts: training data, in resumable chunks"),
    "train": ("hf_eagle31.commands.train", "train an EAGLE-3 / EAGLE 3.1 drafter for a target model"),
    "card": ("hf_eagle31.commands.card", "write a Hub model card (README.md) for a drafter folder"),
    "bench": ("hf_eagle31.commands.bench", "benchmark EAGLE against the target alone and other speculative methods"),
    "plan": ("hf_eagle31.commands.plan", "plan GPU memory for a target + drafter from the target's config alone"),
    "convert": ("hf_eagle31.commands.convert", "convert a drafter between checkpoint layouts, or upgrade EAGLE-3 "
                "to EAGLE 3.1"),
}
# arguments naming a model or drafter to load: a missing folder is named before any loading
MODEL_ARGUMENTS = ("target", "drafter", "eagle3", "eagle31", "assistant", "src", "drafter_dir")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, where there is one to show (not for switches and unset options)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """Usage errors in one line with exit code 2, like every other bad input (argparse prints the whole usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def package_version() -> str:
    try:
        return version("hf-eagle31")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser(command: str | None) -> Parser:
    """Every subcommand with its one-line help; only `command`'s module is imported, to add its options."""
    parser = Parser(prog="hf-eagle31", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, summary) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=summary, description=summary, formatter_class=HelpFormatter)
        if name == command:
            importlib.import_module(module_name).configure_parser(sub_parser)
    return parser


def missing_model(args: argparse.Namespace) -> str | None:
    """The first model argument that can only be a folder on this machine and is not there."""
    from hf_eagle31.packaged import missing_folder

    return next((value for name in MODEL_ARGUMENTS if (value := getattr(args, name, None))
                 and missing_folder(value)), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((arg for arg in argv if not arg.startswith("-")), None)  # the top level takes no option values
    args = build_parser(command).parse_args(argv)
    try:
        missing = missing_model(args)
        if missing is not None:
            raise FileNotFoundError(f"no such folder: {missing}")
        return int(importlib.import_module(SUBCOMMANDS[args.command][0]).run(args) or 0)
    except (ValueError, OSError) as err:  # bad input, or a model transformers cannot load: one line, no stack trace
        print(f"hf-eagle31 {args.command}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
