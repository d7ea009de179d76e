"""The smallest EAGLE 3.1 call: load a target and its drafter, pass the drafter to `generate`.

    python examples/quickstart.py [--target DIR] [--drafter DIR] [--prompt TEXT] [--max-new-tokens N]

Prints the text, what speculation did (`drafter.speculation_stats`), and tokens/s of plain greedy
`generate`, of plain decoding on this package's fastest forward (`custom_generate=hf_eagle31.fast_decoding`) and
of EAGLE on the same prompt in the same run (the best of `--repeats` alternating calls); the speedup is over the
faster plain way. Greedy EAGLE decoding is lossless, so every EAGLE output must equal the plain one.
`examples/demo.py` does the same over several prompts.
"""

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import hf_eagle31  # noqa: E402  (registers the drafter with AutoModel, routes generate(assistant_model=...))

DEMO = Path(__file__).parent / "demo_pair"
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--target", default=str(DEMO / "target"), help="target model folder or Hub id (with its tokenizer)")
parser.add_argument("--drafter", default=str(DEMO / "eagle31"), help="EAGLE-3 / EAGLE 3.1 drafter folder or Hub id")
parser.add_argument("--prompt", default="def _copy_items(items):\n    if items is None:")
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--repeats", type=int, default=3, help="timed calls of each; the fastest counts (noisy machines)")
args = parser.parse_args()

tokenizer = AutoTokenizer.from_pretrained(args.target)
device = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 on a GPU; float32 on a CPU, where batched bf16 matmuls are slow without bf16 matrix units
dtype = torch.bfloat16 if device == "cuda" else torch.float32
target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype, device_map=device).eval()
drafter = AutoModel.from_pretrained(args.drafter, dtype=target.dtype).to(target.device).eval()  # an Eagle3DraftModel
inputs = tokenizer(args.prompt, return_tensors="pt").to(target.device)


def generate(**kwargs) -> tuple[float, torch.Tensor]:
    started = time.perf_counter()
    out = target.generate(**inputs, do_sample=False, max_new_tokens=args.max_new_tokens, **kwargs)
    return time.perf_counter() - started, out


generate(assistant_model=drafter)  # warm-up: the first calls allocate caches and pick kernels
generate(custom_generate=hf_eagle31.fast_decoding)
plain_runs, fast_runs, eagle_runs = [], [], []
for _ in range(args.repeats):  # alternate, so that a busy spell on the machine hits all alike
    plain_runs.append(generate())
    fast_runs.append(generate(custom_generate=hf_eagle31.fast_decoding))
    eagle_runs.append((*generate(assistant_model=drafter), drafter.speculation_stats))
plain_seconds, plain = min(plain_runs, key=lambda run: run[0])
fast_seconds, _ = min(fast_runs, key=lambda run: run[0])
eagle_seconds, eagle, stats = min(eagle_runs, key=lambda run: run[0])
identical = all(torch.equal(run[1], plain) for run in plain_runs + fast_runs + eagle_runs)

prompt_length = inputs.input_ids.shape[1]
plain_rate = (plain.shape[1] - prompt_length) / plain_seconds
fast_rate = (plain.shape[1] - prompt_length) / fast_seconds
eagle_rate = (eagle.shape[1] - prompt_length) / eagle_seconds
best = max(plain_rate, fast_rate)
print(args.prompt + "\033[1m" + tokenizer.decode(eagle[0, prompt_length:], skip_special_tokens=True) + "\033[0m\n")
eagle31 = drafter.config.fc_norm or drafter.config.norm_output
print(f"drafter: {'EAGLE 3.1' if eagle31 else 'EAGLE-3'}, {stats.mode} speculation; "
      f"{stats.speculative_forwards} speculative target forwards, {stats.plain_steps} plain steps, "
      f"{stats.fallbacks} fallbacks")
print(f"tau (tokens per target forward): {stats.tau:.2f}")
print(f"acceptance per depth: {' '.join(f'{rate:.2f}' for rate in stats.acceptance_per_depth)}")
print(f"plain generate: {plain_rate:.1f} tokens/s   fast decoding: {fast_rate:.1f} tokens/s   EAGLE: {eagle_rate:.1f} "
      f"tokens/s   ({device}, {torch.get_num_threads()} threads, {str(dtype).removeprefix('torch.')})")
print(f"speedup over the best plain decoding: {eagle_rate / best:.2f}x   (over generate's defaults: "
      f"{eagle_rate / plain_rate:.2f}x)   identical output: {'yes' if identical else 'NO'}")
