"""Put run_ours.py's and run_vllm.py's reports side by side: acceptance, per-position counts, tokens/s, and
whether the two engines produced the same token ids on every question. Standard library only: any python.

    python examples/vllm_cpu/compare.py OURS.json VLLM.json [OURS.json VLLM.json ...]
"""

import json
import sys


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


def end(row: dict) -> int:
    return len(row["tokens"]) - (1 + row["drafts"] + row["accepted"])


if __name__ == "__main__":
    main(sys.argv[1:])
