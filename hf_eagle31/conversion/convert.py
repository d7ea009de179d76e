"""Convert an EAGLE drafter between checkpoint layouts, losslessly, or upgrade an EAGLE-3 head to EAGLE 3.1.

`hf-eagle31 convert SRC DST [--layout hf_eagle31|eagle|specforge|speculators] [--verifier ID] [--upgrade ...]`
reads SRC in any layout (this project's, the EAGLE reference's, SpecForge's, speculators', NeMo
Automodel's) and writes DST in the chosen one with the weights and the 3.1 switches untouched, or
refuses a head that layout's readers would run differently (`layouts.ExportError`); `--upgrade`
switches the 3.1 norms on and fine-tunes instead (see `upgrade.py`). DST must be new or empty
(`--overwrite` replaces it whole, never the source or a folder holding it); it is written whole or not
at all.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_eagle31.conversion.layouts import LAYOUTS, save_in_layout
from hf_eagle31.conversion.upgrade import add_upgrade_arguments, run_upgrade
from hf_eagle31.folders import replace_folder
from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.packaged import require_hub_id


def convert_checkpoint(src: str | Path, dst: str | Path, layout: str = "hf_eagle31", allow_pickle: bool = False,
                       overwrite: bool = False, verifier: str | None = None, local_verifier: bool = False) -> Path:
    """Read `src` in any supported layout and write it to `dst` in `layout`: same weights, same outputs.

    `verifier` names the target in a speculators export (default: the one `src` records, from its
    speculators config or its model card's `base_model`), by its Hub id unless `local_verifier`. `dst` must be new
    or empty unless
    `overwrite`; it is written whole or not at all (`replace_folder`).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    with replace_folder(dst, overwrite, source=src) as scratch:
        save_in_layout(Eagle3DraftModel.from_pretrained(src, allow_pickle=allow_pickle), scratch, layout, verifier,
                       local_verifier)
    return Path(dst)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Convert an EAGLE drafter between checkpoint layouts, or upgrade EAGLE-3 to EAGLE 3.1."""
    parser.add_argument("src", help="drafter folder or Hub id, in any supported layout")
    parser.add_argument("dst", help="output folder: new or empty (see --overwrite)")
    parser.add_argument("--layout", choices=LAYOUTS, default="hf_eagle31",
                        help="output layout (eagle/specforge/speculators are what vLLM and SGLang serve)")
    parser.add_argument("--verifier", help="the target's Hub id, named in a speculators export (required there when "
                        "the drafter records none; default: the one it records)")
    parser.add_argument("--local-verifier", action="store_true", help="let a speculators export name a folder on "
                        "this machine as its verifier (vLLM elsewhere cannot load it)")
    parser.add_argument("--allow-pickle", action="store_true", help="read a pytorch_model.bin (only for trusted files)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty DST whole (never merged into)")
    add_upgrade_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if not args.upgrade:
        path = convert_checkpoint(args.src, args.dst, args.layout, args.allow_pickle, args.overwrite, args.verifier,
                                  args.local_verifier)
        print(f"wrote {path} ({args.layout} layout)")
        return 0
    if args.layout == "speculators" and not args.local_verifier and (args.verifier or args.target):
        require_hub_id(args.verifier or args.target, "the speculators verifier", "--local-verifier")  # before training
    with replace_folder(args.dst, args.overwrite, source=args.src) as scratch:
        drafter = Eagle3DraftModel.from_pretrained(args.src, allow_pickle=args.allow_pickle)
        upgraded = run_upgrade(args, drafter, scratch)  # saved in this project's layout
        if args.layout != "hf_eagle31":
            save_in_layout(upgraded, scratch / args.layout, args.layout, args.verifier or args.target,
                           args.local_verifier)
    print(f"wrote {args.dst}" + (f" and {Path(args.dst) / args.layout} ({args.layout} layout)"
                                 if args.layout != "hf_eagle31" else ""))
    return 0
