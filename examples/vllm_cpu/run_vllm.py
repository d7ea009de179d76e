"""vLLM's side: the target alone, or with an exported EAGLE-3 / EAGLE 3.1 head, greedy on the held-out questions.

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 \
        ../vllm-venv/bin/python examples/vllm_cpu/run_vllm.py --target TARGET [--drafter EXPORT] --out FILE.json

Run with the vLLM venv's python (README.md). Each question is generated alone (batch 1, as `generate` runs), timed
from the request to its last token; acceptance comes from vLLM's own spec-decode counters (`LLM.get_metrics()`).
"""

import time

from shared import question_ids, run_arguments, write_report
from vllm import LLM, SamplingParams, TokensPrompt


def counters(llm: LLM) -> dict:
    """vLLM's cumulative spec-decode counters: drafts (target forwards that verified a draft), accepted draft
    tokens, and accepted tokens per draft position."""
    seen = {"drafts": 0, "accepted": 0, "per_position": []}
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            seen["drafts"] += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            seen["accepted"] += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            seen["per_position"] = list(metric.values)
    return seen


def main() -> None:
    parser = run_arguments(__doc__, "an exported head (speculators or specforge layout)", "num_speculative_tokens")
    args = parser.parse_args()

    speculative = {"method": "eagle3", "model": args.drafter, "num_speculative_tokens": args.tokens}
    started = time.perf_counter()
    llm = LLM(model=args.target, dtype=args.dtype, max_model_len=2048, seed=0, disable_log_stats=False,
              speculative_config=speculative if args.drafter else None)
    load_seconds = time.perf_counter() - started
    print(f"engine ready in {load_seconds:.0f} s", flush=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    prompts = question_ids(args.target, args.questions)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], SamplingParams(temperature=0.0, max_tokens=16),
                 use_tqdm=False)  # warm-up, not counted

    rows = []
    for ids in prompts:
        before = counters(llm)
        started = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], greedy, use_tqdm=False)[0].outputs[0]
        seconds = time.perf_counter() - started
        after = counters(llm)
        per_position = [a - b for a, b in zip(after["per_position"], before["per_position"] or [0] * args.tokens)]
        rows.append({"tokens": list(out.token_ids), "seconds": seconds, "drafts": after["drafts"] - before["drafts"],
                     "accepted": after["accepted"] - before["accepted"], "per_position": per_position})
    write_report("vllm", args, rows, load_seconds=round(load_seconds, 1))


if __name__ == "__main__":
    main()
