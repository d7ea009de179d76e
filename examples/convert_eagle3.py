"""Bring an existing EAGLE-3 head into this project, export it for vLLM / SGLang, and upgrade it to EAGLE 3.1.

    python examples/convert_eagle3.py [--src DIR] [--target DIR] [--out DIR] [--steps N]

1. export the head in the EAGLE reference layout, as a downloaded EAGLE-3 head looks;
2. convert that back to this project's layout and check the outputs are bit-identical to the original;
3. export to the speculators (vLLM) and SpecForge (SGLang) layouts, re-import, check again;
4. upgrade to EAGLE 3.1 (`fc_norm`, `norm_output` on; calibrate the new norms; short fine-tune) and print
   the held-out acceptance before and after; then greedy-decode with the upgraded head, which must
   reproduce plain `generate` exactly.

The same steps on the command line: `hf-eagle31 convert SRC DST --layout ...` and `... --upgrade`.
"""

import argparse
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import hf_eagle31  # noqa: E402,F401  (routes generate(assistant_model=<EAGLE drafter>))
from hf_eagle31 import Eagle3DraftModel  # noqa: E402
from hf_eagle31.checkpoints import convert_checkpoint  # noqa: E402
from hf_eagle31.conversion.layouts import save_in_layout  # noqa: E402
from hf_eagle31.generation import prepare_drafter  # noqa: E402
from hf_eagle31.training.upgrade import upgrade_drafter  # noqa: E402

DEMO = Path(__file__).parent / "demo_pair"
TRAIN_PROMPTS = Path("runs/demo_drafters/prompts.jsonl")  # the demo drafters' training prompts, if built here


@torch.no_grad()
def draft_outputs(drafter: Eagle3DraftModel, target) -> list[torch.Tensor]:
    """Logits and states of a first draft step (on target features) and a second (on fed-back states)."""
    prepare_drafter(target, drafter)  # shares the target's embedding, fills in implied layer ids
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(drafter.config.vocab_size, (2, 12), generator=generator)
    features = torch.randn(2, 12, 3 * drafter.config.target_hidden_size, generator=generator).to(drafter.dtype)
    first = drafter(ids, features)
    second = drafter(ids.roll(-1, 1), first.hidden_states)
    return [first.logits, first.hidden_states, second.logits, second.hidden_states]


def check_identical(name: str, drafter: Eagle3DraftModel, reference: list[torch.Tensor], target) -> None:
    outputs = draft_outputs(drafter, target)
    same = all(out.dtype == ref.dtype and torch.equal(out, ref) for out, ref in zip(outputs, reference))
    print(f"  {name:44s} layer ids {drafter.config.target_layer_ids}, fc_norm={drafter.config.fc_norm}, "
          f"norm_output={drafter.config.norm_output}: outputs {'identical' if same else 'DIFFERENT'}")
    assert same, f"{name}: the converted drafter's outputs differ from the original's"


def upgrade_data(held_out: list[str], count: int) -> list[dict]:
    """Training-split prompts for calibration and the fine-tune, then the held-out ones for the acceptance."""
    if TRAIN_PROMPTS.is_file():
        train = [json.loads(line) for line in TRAIN_PROMPTS.read_text().splitlines()[:count]]
    else:  # no training prompts here: fine-tune on the other held-out prompts (reported acceptance is then optimistic)
        train = [{"turns": [text]} for text in held_out[len(held_out) // 2:]]
    return train + [{"turns": [text]} for text in held_out[: len(held_out) // 2]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", default=str(DEMO / "eagle3"), help="an EAGLE-3 drafter, in any supported layout")
    parser.add_argument("--target", default=str(DEMO / "target"), help="the target model the drafter serves")
    parser.add_argument("--out", default="runs/convert_eagle3", help="output folder")
    parser.add_argument("--steps", type=int, default=60, help="fine-tuning steps of the upgrade")
    parser.add_argument("--lr", type=float, default=1e-3, help="fine-tuning learning rate of the upgrade")
    parser.add_argument("--prompts", type=int, default=24, help="training prompts for the upgrade")
    args = parser.parse_args()
    out = Path(args.out)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target).eval()
    original = Eagle3DraftModel.from_pretrained(args.src)
    reference = draft_outputs(original, target)

    print("1. export to the EAGLE reference layout (what a downloaded EAGLE-3 head looks like)")
    downloaded = convert_checkpoint(args.src, out / "eagle_reference", layout="eagle")
    print(f"  wrote {downloaded}: {sorted(p.name for p in downloaded.iterdir())}")

    print("2. convert it to this project's layout")
    converted = convert_checkpoint(downloaded, out / "eagle3", layout="hf_eagle31")
    drafter = Eagle3DraftModel.from_pretrained(converted)
    check_identical(f"{converted}", drafter, reference, target)

    print("3. export to the serving layouts and re-import")
    for layout in ("speculators", "specforge"):
        folder = save_in_layout(drafter, out / layout, layout, verifier=args.target,
                                local_verifier=True)  # the demo target is a folder here, not on the Hub
        check_identical(f"{folder} ({layout})", Eagle3DraftModel.from_pretrained(folder), reference, target)

    print(f"4. upgrade to EAGLE 3.1: calibrate fc_norm, fine-tune {args.steps} steps")
    held_out = [json.loads(line)["text"] for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()][:16]
    shutil.rmtree(out / "eagle31", ignore_errors=True)  # the trainer refuses a folder holding an earlier run
    upgraded, reports = upgrade_drafter(
        drafter, target, upgrade_data(held_out, args.prompts), out / "eagle31", tokenizer=tokenizer,
        held_out=len(held_out) // 2, steps=args.steps, lr=args.lr, batch_size=8, ttt_steps=4,
        answer_max_new_tokens=64, max_length=192, feature_cache=str(out / "eagle31" / "features"),
    )
    print(f"  held-out acceptance, teacher-forced on the target's own answers to {len(held_out) // 2} prompts:")
    for name, report in reports.items():
        print(f"  {name:40s} per depth {' '.join(f'{a:.3f}' for a in report.acceptance)}   "
              f"expected accepted length {report.expected_length:.3f}")
    exported = save_in_layout(upgraded, out / "eagle31_speculators", "speculators", verifier=args.target,
                              local_verifier=True)
    print(f"  wrote {out / 'eagle31'} and {exported}")

    upgraded = upgraded.to(target.dtype).eval()
    inputs = tokenizer(held_out[-1], return_tensors="pt")
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=64)
    eagle = target.generate(**inputs, do_sample=False, max_new_tokens=64, assistant_model=upgraded)
    stats = upgraded.speculation_stats
    print(f"5. greedy decoding with the upgraded head: tau {stats.tau:.2f}, identical to plain generate: "
          f"{'yes' if torch.equal(plain, eagle) else 'NO'}")
    assert torch.equal(plain, eagle), "EAGLE greedy decoding changed the target's output"


if __name__ == "__main__":
    main()
