"""Time candidate target shapes before training one.

Speculative decoding on a CPU only pays when one target forward clearly costs more than one
drafter forward, and at these sizes a forward's cost is mostly per-layer overhead, not FLOPs.
This prints, for each shape, its bf16 size, the 1-token decode latency with ~200 tokens already
in a DynamicCache (bf16 and fp32), and training throughput, so the choice is made on numbers.

    python examples/reproduce/demo_pair/measure_shapes.py
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

VOCAB = 8192
CONTEXT = 200

# name: (hidden, layers, intermediate, heads, kv_heads)
SHAPES = {
    "8x384": (384, 8, 1024, 6, 2),
    "12x320": (320, 12, 864, 5, 1),
    "16x256": (256, 16, 704, 4, 2),
    "20x256": (256, 20, 704, 4, 2),
    "1x384 (drafter-like)": (384, 1, 1024, 6, 2),
    "1x256 (drafter-like)": (256, 1, 704, 4, 2),
    "2x256 (small LM)": (256, 2, 512, 4, 2),
}


def make(hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
        num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def decode_ms(model: LlamaForCausalLM, dtype: torch.dtype, reps: int = 60) -> float:
    model = model.to(dtype)
    ids = torch.randint(0, VOCAB, (1, CONTEXT))
    cache = DynamicCache()
    model(ids, past_key_values=cache, use_cache=True)
    step = ids[:, -1:]
    times = []
    for i in range(reps):
        position = torch.tensor([[CONTEXT + i]])
        start = time.perf_counter()
        model(step, past_key_values=cache, position_ids=position, use_cache=True)
        times.append(time.perf_counter() - start)
        cache.crop(-1)  # drop the new token: the context stays at CONTEXT
    return 1000 * sorted(times)[len(times) // 2]


def train_tokens_per_s(model: LlamaForCausalLM, batch: int = 8, seq: int = 512, steps: int = 3) -> float:
    """Tokens/s of an fp32-master, bf16-autocast training step, as train_target.py runs it."""
    model = model.float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, VOCAB, (batch, seq))
    for i in range(steps + 1):
        if i == 1:
            start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return batch * seq * steps / (time.perf_counter() - start)


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    print(f"{'shape':20s} {'params':>8s} {'MB bf16':>8s} {'ms bf16':>8s} {'ms fp32':>8s} {'train tok/s':>11s}")
    for name, shape in SHAPES.items():
        model = make(*shape)
        params = sum(p.numel() for p in model.parameters())
        bf16, fp32 = decode_ms(model, torch.bfloat16), decode_ms(model, torch.float32)
        print(f"{name:20s} {params / 1e6:7.1f}M {params * 2 / 1e6:8.1f} {bf16:8.2f} {fp32:8.2f} "
              f"{train_tokens_per_s(model):11.0f}", flush=True)


if __name__ == "__main__":
    main()
