"""Tune a saved drafter's shapes for batches on this machine, keeping its calibrated acceptance.

    python examples/reproduce/measurements/tune_batch_sizes.py examples/smollm2/eagle31 --target smollm2-135m-instruct
    python examples/reproduce/measurements/tune_batch_sizes.py examples/demo_pair/eagle31 --target examples/demo_pair/target

Measures batched verify and draft costs (`hf_eagle31.tuning.batch_costs`) beside the one-row
tuning in the folder's tuning.json, and writes `batch_shapes` into its generation_config.json.
Time it on a quiet machine: the costs are timings.
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hf_eagle31.generation import prepare_drafter
from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.packaged import resolve_model
from hf_eagle31.tuning import tune_batch_sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafter", type=Path)
    parser.add_argument("--target", required=True, help="folder, Hub id or packaged name")
    args = parser.parse_args()
    target = AutoModelForCausalLM.from_pretrained(resolve_model(args.target), dtype=torch.float32).eval()
    drafter = Eagle3DraftModel.from_pretrained(args.drafter, dtype=torch.float32).eval()
    prepare_drafter(target, drafter)
    report = tune_batch_sizes(target, drafter, json.loads((args.drafter / "tuning.json").read_text()))
    (args.drafter / "tuning.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    drafter.generation_config.save_pretrained(args.drafter)
    for size, shape in drafter.generation_config.batch_shapes.items():
        print(f"batch {size}: {shape}")


if __name__ == "__main__":
    main()
