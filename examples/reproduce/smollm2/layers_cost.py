"""What a second decoder layer costs a draft level: the shipped EAGLE 3.1 drafter with one and two layers,
interleaved in one process, fp32 and bf16, on packed weights as decoding runs them (run on a quiet machine).

    .venv/bin/python examples/reproduce/smollm2/layers_cost.py
"""

import copy
import statistics
from pathlib import Path

import torch

from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.packaged import load_packaged_model
from hf_eagle31.backends import backend_for
from hf_eagle31.training.capacity import add_decoder_layers
from hf_eagle31.tuning import draft_cost

SHAPES = ((1, 4), (5, 3))  # (width, levels): the shipped chain of 4, the shipped tree drafted 5 wide, 3 levels
ROUNDS = 6


def main() -> None:
    target, _ = load_packaged_model("smollm2-135m-instruct")
    for dtype in (torch.float32, torch.bfloat16):
        one = Eagle3DraftModel.from_pretrained(Path(__file__).resolve().parents[2] / "smollm2" / "eagle31", dtype=dtype).eval()
        one.set_target_embedding(target.get_input_embeddings())
        two = copy.deepcopy(one)
        add_decoder_layers(two, 2)
        for width, levels in SHAPES:
            costs = {1: [], 2: []}
            for _ in range(ROUNDS):
                for layers, drafter in ((1, one), (2, two)):
                    products = backend_for(target, True).products(drafter)
                    with torch.no_grad():
                        costs[layers].append(draft_cost(drafter, levels, width, products=products) * 1e3 / levels)
            a, b = statistics.median(costs[1]), statistics.median(costs[2])
            print(f"{str(dtype)[6:]} width {width}, {levels} levels: ms a level, 1 layer {a:.2f}, 2 layers {b:.2f} "
                  f"({b / a:.2f}x)")


if __name__ == "__main__":
    main()
