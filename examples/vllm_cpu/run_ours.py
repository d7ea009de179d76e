"""Our side: the same target alone, or with the same drafter (EAGLE 3.1 or EAGLE-3, before export), greedy on the
same held-out questions, in the shape vLLM runs: a chain of 3, no dynamic length, no collapse fallback (or, with
`--tuned`, the drafter's own tuned shape: each engine at its best).

    .venv/bin/python examples/vllm_cpu/run_ours.py --target TARGET [--drafter examples/smollm2/eagle31] --out FILE.json

Each question is generated alone (batch 1), timed from the call to its return (with `--pack-once` the loop runs
inside `hold_products`, as a server would: the products are made once, before the warm-up, instead of in each
call); the acceptance counters are
`drafter.speculation_stats` (tau: tokens per speculative target forward, the bonus token included).
"""

import contextlib
import time

import torch
from shared import question_ids, run_arguments, write_report
from transformers import AutoModelForCausalLM

from hf_eagle31 import Eagle3DraftModel, drafting_dtype, fast_decoding, hold_products


def main() -> None:
    parser = run_arguments(__doc__, "a drafter folder (any layout)", "num_assistant_tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--drafter-dtype", default="", help="default: bf16 where the CPU computes it (drafting_dtype)")
    parser.add_argument("--tuned", action="store_true", help="the drafter's own tuned shape (its generation config) "
                        "instead of a chain of --tokens")
    parser.add_argument("--mode", choices=["chain", "tree"], help="with --tuned: this mode in its tuned shape (the "
                        "drafter keeps its best chain and best tree) instead of the faster one")
    parser.add_argument("--pack-once", action="store_true", help="pack the weights once for all questions")
    parser.add_argument("--compile-verify", action="store_true", help="the compiled verify forward (compile_verify; "
                        "the warm-up call compiles); with --fast, fast decoding's compiled step (compile_step)")
    parser.add_argument("--fast", action="store_true", help="without --drafter: plain decoding on fast_decoding, the "
                        "package's fastest plain decoding, instead of generate at default settings")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype)).eval()
    drafter = None
    if args.drafter:
        shape = {"speculation_mode": "chain", "num_assistant_tokens": args.tokens}
        if args.tuned:
            shape = {"speculation_mode": args.mode} if args.mode else {}
        drafter = Eagle3DraftModel.from_pretrained(args.drafter, dynamic_speculation=False, collapse_fallback=False,
                                                   compile_verify=args.compile_verify, **shape)
        config = drafter.generation_config
        if args.tuned:  # per-position counters
            args.tokens = config.tree_depth if config.speculation_mode == "tree" else config.num_assistant_tokens
        drafter = drafter.to(getattr(torch, args.drafter_dtype) if args.drafter_dtype else drafting_dtype(target)).eval()
    prompts = question_ids(args.target, args.questions)
    greedy = {"do_sample": False, "assistant_model": drafter} if drafter else {"do_sample": False}
    if args.fast and not drafter:
        greedy |= {"custom_generate": fast_decoding, "compile_step": args.compile_verify}
    rows = []
    with contextlib.ExitStack() as packing:
        if args.pack_once and drafter:
            packing.enter_context(hold_products(target))
            packing.enter_context(hold_products(drafter))
        target.generate(torch.tensor([prompts[0]]), max_new_tokens=16, **greedy)  # warm-up, not counted
        for ids in prompts:
            started = time.perf_counter()
            out = target.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, **greedy)
            seconds = time.perf_counter() - started
            row = {"tokens": out[0, len(ids):].tolist(), "seconds": seconds}
            if drafter:
                stats = drafter.speculation_stats
                row |= {"drafts": stats.speculative_forwards,
                        "accepted": stats.speculative_tokens - stats.speculative_forwards,
                        "per_position": list(stats.accepted) + [0] * (args.tokens - len(stats.accepted))}
            rows.append(row)
    shape = None
    if drafter is not None and args.tuned:
        shape = (f"tree: top-k {config.tree_top_k}, depth {config.tree_depth}, {config.tree_total_tokens} tokens"
                 if config.speculation_mode == "tree" else f"chain of {config.num_assistant_tokens}")
    write_report("hf_eagle31", args, rows, drafter_dtype=str(drafter.dtype).removeprefix("torch.") if drafter else None,
                 shape=shape, packed_once=bool(args.pack_once and drafter),
                 compiled_verify=bool(args.compile_verify and drafter), fast_decoding=bool(args.fast and not drafter),
                 compiled_step=bool(args.fast and args.compile_verify and not drafter))


if __name__ == "__main__":
    main()
