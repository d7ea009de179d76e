"""Convert an EAGLE drafter between checkpoint layouts, losslessly, or upgrade an EAGLE-3 head to EAGLE 3.1.

`hf-eagle31 convert SRC DST [--layout hf_eagle31|eagle|specforge|speculators] [--upgrade ...]`
reads SRC in any layout (this project's, the EAGLE reference's, SpecForge's, speculators') and writes
DST in the chosen one with the weights and the 3.1 switches untouched; `--upgrade` switches the 3.1
norms on and fine-tunes instead (see `upgrade.py`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_eagle31.conversion.layouts import LAYOUTS, save_in_layout
from hf_eagle31.conversion.upgrade import add_upgrade_arguments, run_upgrade
from hf_eagle31.modeling import Eagle3DraftModel


def convert_checkpoint(src: str | Path, dst: str | Path, layout: str = "hf_eagle31", allow_pickle: bool = False) -> Path:
    """Read `src` in any supported layout and write it to `dst` in `layout`: same weights, same outputs."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    drafter = Eagle3DraftModel.from_pretrained(src, allow_pickle=allow_pickle)
    return save_in_layout(drafter, dst, layout)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Convert an EAGLE drafter between checkpoint layouts, or upgrade EAGLE-3 to EAGLE 3.1."""
    parser.add_argument("src", help="drafter folder or Hub id, in any supported layout")
    parser.add_argument("dst", help="output folder")
    parser.add_argument("--layout", choices=LAYOUTS, default="hf_eagle31",
                        help="output layout (eagle/specforge/speculators are what vLLM and SGLang serve)")
    parser.add_argument("--allow-pickle", action="store_true", help="read a pytorch_model.bin (only for trusted files)")
    add_upgrade_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if not args.upgrade:
        path = convert_checkpoint(args.src, args.dst, args.layout, args.allow_pickle)
        print(f"wrote {path} ({args.layout} layout)")
        return 0
    drafter = Eagle3DraftModel.from_pretrained(args.src, allow_pickle=args.allow_pickle)
    upgraded = run_upgrade(args, drafter, args.dst)  # saved to DST in this project's layout
    if args.layout != "hf_eagle31":
        print(f"wrote {save_in_layout(upgraded, Path(args.dst) / args.layout, args.layout)} ({args.layout} layout)")
    return 0
