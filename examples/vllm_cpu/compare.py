"""Put run_ours.py's and run_vllm.py's reports side by side: acceptance, per-position counts, tokens/s, and
whether the two engines produced the same token ids on every question; or, with `--rounds`, the tokens/s of
rounds run in turn and each of our runs over each of vLLM's, round by round and their median. Standard library
only: any python.

    python examples/vllm_cpu/compare.py OURS.json VLLM.json [OURS.json VLLM.json ...]
    python examples/vllm_cpu/compare.py --rounds ROUND_DIR [ROUND_DIR ...]

Why rounds: on a shared VM the memory's rate moves by more than the engines differ (one configuration run twice
in a round moved by up to 25%), so a ratio holds between runs made close together, and one round proves little.
"""

import json
import statistics
import sys
from pathlib import Path


def main(paths: list[str]) -> None:
    for ours_path, vllm_path in zip(paths[::2], paths[1::2], strict=True):
        ours, vllm = (json.load(open(p)) for p in (ours_path, vllm_path))
        print(f"{ours_path} vs {vllm_path}")
        for name, run in (("ours", ours), ("vLLM", vllm)):
            s = run["summary"]
            accept = (f"  acceptance length {s['acceptance_length']:.3f}  per position {s['per_position']}"
                      f"  drafts {s['drafts']}" if "drafts" in s else "")
            print(f"  {name:5} {s['tokens_per_s']:6.2f} tok/s  {s['new_tokens']} tokens in {s['seconds']:.1f} s{accept}")
        pairs = list(zip(ours["questions"], vllm["questions"], strict=True))
        same = sum(a["tokens"] == b["tokens"] for a, b in pairs)
        print(f"  identical token ids on {same} of {len(pairs)} questions")
        if "drafts" in ours["summary"]:
            counts = sum(a["per_position"] == b["per_position"] for a, b in pairs)
            print(f"  per-position counts equal on {counts} of {len(pairs)} questions; per question (ours | vLLM), with"
                  " `end`: new tokens - (first token + drafts + accepted): +1, a last token made without a draft;"
                  " -n, n accepted tokens counted past EOS or the length cap, then dropped")
            for i, (a, b) in enumerate(pairs):
                print(f"    q{i}: {len(a['tokens']):3} tokens {a['drafts']:4} drafts {a['per_position']} end {end(a):+d}"
                      f" | {b['drafts']:4} drafts {b['per_position']} end {end(b):+d}")


def rounds(folders: list[str]) -> None:
    """Each folder one round: the reports in it (`*.json`, named by run), every round running the same runs in
    turn. Prints tokens/s per run and round, then each `ours*` run over each `vllm*` run per round, and the median."""
    speed = [{path.stem: json.load(open(path))["summary"]["tokens_per_s"] for path in sorted(Path(f).glob("*.json"))}
             for f in folders]
    runs = sorted(set().union(*speed))
    print(f"{'tokens/s':24}" + "".join(f"{f'round {i + 1}':>10}" for i in range(len(folders))) + f"{'median':>10}")
    for run in runs:
        seen = [round_.get(run) for round_ in speed]
        print(f"{run:24}" + "".join(f"{'-' if v is None else f'{v:.1f}':>10}" for v in seen) +
              f"{statistics.median(v for v in seen if v is not None):10.1f}")
    print("ours over vLLM, the same round")
    for ours in (run for run in runs if run.startswith("ours")):
        for vllm in (run for run in runs if run.startswith("vllm")):
            ratios = [r[ours] / r[vllm] for r in speed if ours in r and vllm in r]
            if ratios:
                print(f"{ours + ' / ' + vllm:40}" + "".join(f"{v:7.2f}" for v in ratios) +
                      f"   median {statistics.median(ratios):.2f}")


def end(row: dict) -> int:
    return len(row["tokens"]) - (1 + row["drafts"] + row["accepted"])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rounds"]:
        rounds(sys.argv[2:])
    else:
        main(sys.argv[1:])
