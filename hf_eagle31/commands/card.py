"""`hf-eagle31 card`: write a Hub model card (README.md with metadata) for a drafter folder
(`hf_eagle31.model_cards.card`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_eagle31.model_cards.card import write_model_card


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Write a model card (README.md) for a drafter folder."""
    parser.add_argument("drafter_dir", help="folder of a saved drafter")
    parser.add_argument("--base-model", help="the target model's Hub id (or packaged name)")
    parser.add_argument("--local-base-model", action="store_true", help="write a --base-model that is not a Hub id "
                        "(a folder) as given")
    parser.add_argument("--dataset", action="append", help="Hub id of a dataset the training prompts came from "
                        "(repeatable)")
    parser.add_argument("--bench", help="benchmark results (JSON) for the acceptance table")
    parser.add_argument("--license", default="apache-2.0", help="license id (use the target's)")
    parser.add_argument("--overwrite", action="store_true", help="replace a README.md that hf-eagle31 did not write")


def run(args: argparse.Namespace) -> None:
    write_model_card(args.drafter_dir, base_model=args.base_model, benchmark=args.bench, license=args.license,
                     local_base_model=args.local_base_model, datasets=args.dataset, overwrite=args.overwrite)
    print(f"wrote {Path(args.drafter_dir) / 'README.md'}")
