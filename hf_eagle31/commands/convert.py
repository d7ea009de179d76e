"""Convert an EAGLE drafter between checkpoint layouts, losslessly, or upgrade an EAGLE-3 head to EAGLE 3.1.

`hf-eagle31 convert SRC DST [--layout hf_eagle31|eagle|specforge|speculators] [--verifier ID] [--upgrade ...]`
reads SRC in any layout (this project's, the EAGLE reference's, SpecForge's, speculators', NeMo
Automodel's) and writes DST in the chosen one with the weights and the 3.1 switches untouched, or
refuses a head that layout's readers would run differently (`layouts.ExportError`); `--upgrade`
switches the 3.1 norms on and fine-tunes instead (`hf_eagle31.training.upgrade`). DST must be new or empty
(`--overwrite` replaces it whole, never the source or a folder holding it); it is written whole or not
at all.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_eagle31.checkpoints import convert_checkpoint
from hf_eagle31.conversion.layouts import LAYOUTS, save_in_layout
from hf_eagle31.folders import replace_folder
from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.packaged import load_target, require_hub_id
from hf_eagle31.training.trainer import TrainingConfig
from hf_eagle31.training.upgrade import upgrade_drafter


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


def add_upgrade_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--upgrade` options of `hf-eagle31 convert`."""
    group = parser.add_argument_group("EAGLE-3 -> 3.1 upgrade")
    group.add_argument("--upgrade", action="store_true",
                       help="switch fc_norm and norm_output on, calibrate the new norms, fine-tune (needs --target, --data)")
    group.add_argument("--target", help="the target model the drafter serves (upgrade)")
    group.add_argument("--data", help="JSONL of prompts for calibration and fine-tuning (upgrade)")
    group.add_argument("--upgrade-steps", type=int, default=200, help="fine-tuning optimizer steps (upgrade)")
    group.add_argument("--upgrade-lr", type=float, default=5e-5, help="fine-tuning learning rate (upgrade)")
    group.add_argument("--held-out", type=int, default=8, help="sequences kept for the before/after acceptance (upgrade)")
    group.add_argument("--tune-prompts", type=int, default=TrainingConfig.tune_prompts, help="sequences kept to tune "
                       "the draft shape on at the end (0: keep the default shape) (upgrade)")


def run_upgrade(args: argparse.Namespace, drafter: Eagle3DraftModel, out_dir: str | Path) -> Eagle3DraftModel:
    """`hf-eagle31 convert ... --upgrade`: upgrade the converted `drafter` into `out_dir` and print the acceptance."""
    if not (args.target and args.data):
        raise ValueError("--upgrade needs --target (the target model) and --data (prompts to calibrate and fine-tune on)")
    target, tokenizer = load_target(args.target)
    tuned, reports = upgrade_drafter(drafter, target, args.data, out_dir, tokenizer=tokenizer, held_out=args.held_out,
                                     steps=args.upgrade_steps, lr=args.upgrade_lr, tune_prompts=args.tune_prompts)
    for name, report in reports.items():
        print(f"{name:42s} acceptance per depth: {' '.join(f'{a:.3f}' for a in report.acceptance)}"
              f"   expected accepted length {report.expected_length:.3f}")
    return tuned
