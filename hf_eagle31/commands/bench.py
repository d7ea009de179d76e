"""`hf-eagle31 bench`: benchmark EAGLE-3 / 3.1 against the target alone, assisted generation and prompt lookup
(`hf_eagle31.bench.suite`)."""

from __future__ import annotations

import argparse

import torch

from hf_eagle31.bench.suite import CALIBRATION_PROMPTS, PAIRS, run_benchmark


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Benchmark EAGLE decoding against the target alone and other speculative methods."""
    add = parser.add_argument
    add("--pair", choices=sorted(PAIRS), default="smollm2", help="shipped models and prompts to use "
        "(smollm2: SmolLM2-135M-Instruct and its drafters on MT-Bench, GSM8K, HumanEval, Alpaca; demo: the 17M pair)")
    add("--target", help="target model folder, Hub id or packaged name (with its tokenizer); a target other than "
        "the pair's uses no drafter or assistant unless given")
    add("--eagle3", help="EAGLE-3 drafter ('' to skip)")
    add("--eagle31", help="EAGLE 3.1 drafter ('' to skip)")
    add("--assistant", help="small LM for transformers' assisted generation ('' to skip)")
    add("--prompts", nargs="+", help="JSONL files with 'text' or 'turns' per line, one dataset each")
    add("--calibration", help="JSONL prompts ('text' or 'turns') to tune the draft shapes on ('': prompts of the "
        "measured files that are not measured)")
    add("--documents", help="--drift: long texts (JSONL, 'text' or 'turns') to cut context-length prompts from")
    add("--num-prompts", type=int, default=20, help="prompts measured per dataset, spread over the file; "
        f"{CALIBRATION_PROMPTS} others in all calibrate the tuning")
    add("--max-new-tokens", type=int, default=128, help="tokens generated per prompt by every method")
    add("--temperature", type=float, default=0.0, help="0: greedy (outputs checked against the target's); "
        "> 0: sampling, the same seed per prompt for every method")
    add("--no-chat-template", action="store_true", help="tokenize prompts as plain text even if the tokenizer "
        "has a chat template")
    add("--verify-modes", action="store_true", help="also run EAGLE 3.1 tree with micro-batched and exact verify")
    add("--prompt-lookup-tokens", type=int, default=10, help="prompt lookup decoding's draft length")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where the models run")
    add("--dtype", default="auto", help="auto (float32 on CPU, the checkpoint's dtype on CUDA), bfloat16, float16 "
        "or float32")
    add("--drafter-dtype", default="", help="the drafters' dtype (default: bf16 where the device computes it at full "
        "speed, else the target's); drafting in bf16 beside an fp32 target streams half the bytes, and the target's "
        "verification keeps the output exact")
    add("--compile-verify", action="store_true", help="the drafters' calls verify with the compiled lean forward "
        "(compile_verify) and fast decoding compiles its step (compile_step); their first calls compile, for "
        "minutes; --verify-cost measures that path too")
    add("--no-tune", action="store_true", help="keep the drafters' tree shapes instead of tuning them here")
    add("--drift", action="store_true", help="run the EAGLE-3 vs EAGLE 3.1 attention-drift study instead")
    add("--verify-cost", action="store_true", help="measure the verify-cost curve t(n)/t(1) on torch's default path "
        "and on the CPU backend instead (interleaved rounds)")
    add("--batch-sizes", help="run plain batched generate against batched EAGLE 3.1 chain and tree at these batch "
        "sizes instead (e.g. 1,4,8,16), on the same prompts")
    add("--project", nargs="+", metavar="SHAPE", help="also project speedups to real model shapes "
        "(Llama-3.1-8B, Qwen2.5-7B) from costs measured here and this run's EAGLE 3.1 acceptance")
    add("--part-size", type=int, help="run each dataset in parts of this many prompts (every method on a part, "
        "then the next part), saving each part's results as it ends (default: the whole dataset at once)")
    add("--max-parts", type=int, help="stop after this many parts of each dataset (results cover those); a later "
        "--resume with a larger number goes on")
    add("--resume", action="store_true", help="reuse the parts and the tuning an interrupted run with the same "
        "settings saved in --out, and run only what is missing")
    add("--out", default="runs/bench", help="folder for results.json, results.md and the plots")


def run(args: argparse.Namespace) -> int:
    return run_benchmark(args)
