"""Memory planner: byte counts checked against hand arithmetic for real model shapes, against real
models' tensors, and (where bitsandbytes is installed) against bitsandbytes' own quantized tensors."""

import json

import pytest
import torch
from tiny_models import VOCAB, make_drafter, make_target
from transformers import AutoModelForCausalLM, DynamicCache, Gemma3TextConfig, LlamaConfig, Qwen2Config

from hf_eagle31.cli import main as cli_main
from hf_eagle31.planner import (
    GiB,
    MiB,
    Planner,
    drafter_memory_report,
    meta_model,
    parse_memory,
    target_weight_bytes,
    tensor_bytes,
)

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LLAMA_31_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                   max_position_embeddings=131072, tie_word_embeddings=False, rope_parameters=LLAMA3)
LLAMA_31_70B = dict(LLAMA_31_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                    num_attention_heads=64)
QWEN_25_7B = dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                  num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                  max_position_embeddings=32768, tie_word_embeddings=False, use_sliding_window=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
RTX_4090 = 24564 * MiB
ROTARY_BUFFERS = 2 * 64 * 4  # inv_freq and original_inv_freq: head_dim / 2 fp32 each


def config_file(tmp_path, fields: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    return path


@pytest.fixture(scope="module")
def llama_8b(tmp_path_factory):
    return Planner(config_file(tmp_path_factory.mktemp("llama8b"), LLAMA_31_8B))


# --- Llama-3.1-8B by hand ------------------------------------------------------------------
# per decoder layer: q 4096*4096 = 16,777,216; k, v 1024*4096 = 4,194,304 each; o 16,777,216;
# gate, up, down 14336*4096 = 58,720,256 each: 218,103,808 elements in 7 Linears, 32 layers:
# 6,979,321,856 quantized elements in 224 Linears with 4096+1024+1024+4096+14336+14336+4096 = 43,008
# output rows per layer. Left in 16-bit: embed_tokens and lm_head 128256*4096 = 525,336,576 each,
# norms (2*32+1)*4096 = 266,240.
LLAMA_8B_LINEAR = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)
LLAMA_8B_16BIT = 2 * 525_336_576 + 266_240


def test_llama_8b_weights_by_hand(llama_8b):
    assert LLAMA_8B_LINEAR == 6_979_321_856
    assert LLAMA_8B_LINEAR + LLAMA_8B_16BIT == 8_030_261_248  # Llama-3.1-8B's published parameter count
    assert llama_8b.weights("bf16") == 8_030_261_248 * 2 + ROTARY_BUFFERS == 16_060_523_008
    assert llama_8b.weights("fp32") == 8_030_261_248 * 4 + ROTARY_BUFFERS
    # int8: one byte an element, one fp32 scale per output row
    assert llama_8b.weights("int8") == 6_979_321_856 + 4 * 43_008 * 32 + 2 * 1_050_939_392 + 512 == 9_086_706_176
    # nf4: half a byte an element, one fp32 absmax per 64 elements, a 64-byte code book per Linear
    nf4 = 6_979_321_856 // 2 + 4 * (6_979_321_856 // 64) + 224 * 64 + 2 * 1_050_939_392 + 512
    assert nf4 == 6_027_762_176
    assert llama_8b.weights("nf4") == llama_8b.weights("fp4") == nf4
    # double quant: absmax in uint8, one fp32 absmax per 256 of them, a 1 KiB code book and an fp32 offset
    nf4_dq = 3_489_660_928 + 109_051_904 + 4 * (109_051_904 // 256) + 224 * (64 + 1024 + 4) + 2_101_878_784 + 512
    assert nf4_dq == 5_702_540_672
    assert llama_8b.weights("nf4-dq") == nf4_dq


def test_llama_8b_drafter_kv_and_tree_by_hand(llama_8b):
    # drafter: fc 3*4096 -> 4096; q/k/v read 2*4096; MLP like the target's; 4 norms + 3 fc_norms; lm_head
    # over 32000 draft tokens; bf16. Buffers: d2t int64 32000, t2d bool 128256, rotary 2*64 in bf16.
    params = (12288 * 4096 + 8192 * 4096 + 2 * 8192 * 1024 + 4096 * 4096 + 3 * 14336 * 4096
              + 7 * 4096 + 32000 * 4096)
    assert params == 424_701_952
    assert llama_8b.drafter_bytes == 2 * params + 8 * 32000 + 128256 + 2 * 64 * 2 == 849_788_416
    parts = llama_8b.components("nf4", context=8192, tree_tokens=61)
    assert parts["target KV cache (8192 tokens)"] == 32 * 2 * 8 * 128 * 8192 * 2 == GiB
    assert parts["drafter KV cache (8253 tokens)"] == 1 * 2 * 8 * 128 * 8253 * 2 == 33_804_288
    logits, features = 61 * 128256 * 4, 3 * 61 * 4096 * 2
    kv_rows, mask = 32 * 2 * 8 * 128 * 61 * 2, 61 * (8192 + 61)
    assert parts["tree buffers (61 tokens)"] == logits + features + kv_rows + mask == 41_292_425
    # workspace estimate: the drafter's catch-up over the 8192-token prompt is the largest forward:
    # per token 2*12288 (features, queued + concatenated) + 4*4096 (fc out, embeds, their concat)
    # + 2*4096 + 2*1024 (q/o, k/v) + 3*14336 (MLP) = 94,208 bf16 values, and 32000 logits for the
    # last position only; plus one dequantized down_proj (14336*4096 bf16) and 512 MiB of CUDA context.
    assert parts["workspace (estimate)"] == 8192 * 94_208 * 2 + 32000 * 2 + 14336 * 4096 * 2 + 512 * MiB


def test_qwen_7b_by_hand(tmp_path):
    planner = Planner(config_file(tmp_path, QWEN_25_7B))
    # per layer: q 3584*3584 (+3584 bias), k and v 512*3584 (+512 bias each), o 3584*3584,
    # gate/up/down 18944*3584: 233,046,016 Linear weights and 4,608 biases; 28 layers.
    linear = 28 * (2 * 3584 * 3584 + 2 * 512 * 3584 + 3 * 18944 * 3584)
    kept = 28 * 4608 + 2 * 152064 * 3584 + (2 * 28 + 1) * 3584  # biases, untied embed + lm_head, norms
    assert linear == 6_525_288_448
    assert linear + kept == 7_615_616_512  # Qwen2.5-7B's published parameter count
    assert planner.weights("bf16") == 2 * 7_615_616_512 + ROTARY_BUFFERS
    nf4 = linear // 2 + 4 * (linear // 64) + 196 * 64 + 2 * kept + ROTARY_BUFFERS
    assert planner.weights("nf4") == nf4 == 5_851_143_936
    parts = planner.components("nf4", context=32768, tree_tokens=61)
    assert parts["target KV cache (32768 tokens)"] == 28 * 2 * 4 * 128 * 32768 * 2 == 1_879_048_192


def test_70b_nf4_does_not_fit_a_24gb_card(tmp_path):
    planner = Planner(config_file(tmp_path, LLAMA_31_70B))
    linear = 80 * (2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 28672 * 8192)  # 68,451,041,280
    kept = 2 * 128256 * 8192 + 161 * 8192
    nf4 = linear // 2 + 4 * (linear // 64) + 560 * 64 + 2 * kept + ROTARY_BUFFERS
    assert planner.weights("nf4") == nf4 == 42_709_077_504  # 39.78 GiB: more than the card before any cache
    plan = planner.plan("nf4", context=8192, tree_tokens=61, gpu_bytes=RTX_4090, gpu_name="RTX 4090")
    assert plan.fits is False
    assert plan.longest_context is None
    assert plan.advice[0] == (f"does not fit: needs {plan.total / GiB:.2f} GiB, the card has 23.99 GiB "
                              f"(short by {(plan.total - RTX_4090) / GiB:.2f} GiB).")
    assert "leave no memory for any context" in plan.advice[1]
    assert not any(line.startswith("--quant") for line in plan.advice)  # not even nf4-dq fits 24 GB
    # ~49.2 GiB in nf4: more than a 48 GB card (47.99 GiB), so the next size up; in nf4-dq (weights
    # ~36.9 GiB) + drafter + cache + workspace come to ~46 GiB: a 48 GB card
    assert 48 * GiB < plan.total < 81559 * MiB
    assert plan.advice[-2] == "the H100 80 GB fits it at 8192 tokens with nf4."
    assert plan.advice[-1] == "the RTX A6000 48 GB fits it at 8192 tokens with --quant nf4-dq."
    assert planner.total("nf4-dq", 8192, 61) <= 49140 * MiB


def test_smaller_quantization_advised_when_it_fits(llama_8b):
    plan = llama_8b.plan("bf16", context=8192, tree_tokens=61, gpu_bytes=16 * GiB)
    assert plan.fits is False
    assert "--quant int8 fits at 8192 tokens on this card." in plan.advice  # the least lossy that fits


def test_longest_context_by_hand(llama_8b):
    # bf16 Llama-3.1-8B on an RTX 4090. Past a few hundred tokens every term is linear in the context C:
    # per token: target KV 32*2*8*128*2 = 131,072; drafter KV 2*8*128*2 = 4,096; tree mask 61 bools;
    # drafter catch-up activations 94,208 * 2 = 188,416.
    per_token = 131_072 + 4_096 + 61 + 188_416
    # fixed: weights, drafter, CUDA context; tree logits, features, KV rows, its own mask, drafter KV of
    # the tree; the drafter's last-position logits
    fixed = (16_060_523_008 + 849_788_416 + 512 * MiB + 61 * 128256 * 4 + 3 * 61 * 4096 * 2
             + 32 * 2 * 8 * 128 * 61 * 2 + 61 * 61 + 2 * 8 * 128 * 61 * 2 + 32000 * 2)
    longest = (RTX_4090 - fixed) // per_token
    assert longest == 25549
    plan = llama_8b.plan("bf16", context=8192, tree_tokens=61, gpu_bytes=RTX_4090)
    assert plan.fits and plan.longest_context == longest
    assert llama_8b.total("bf16", longest, 61) <= RTX_4090 < llama_8b.total("bf16", longest + 1, 61)
    assert "the longest context that fits is 25549 tokens." in plan.advice
    # nf4 on 80 GiB: at the model's whole context (16 GiB of KV cache, ~23 GiB of catch-up activations)
    # it still fits, and the search stops at max_position_embeddings
    assert llama_8b.total("nf4", 131072, 61) <= 80 * GiB
    plan = llama_8b.plan("nf4", context=8192, tree_tokens=61, gpu_bytes=80 * GiB)
    assert plan.longest_context == 131072
    assert "the longest context that fits is 131072 tokens (the model's maximum)." in plan.advice


# google/gemma-3-270m: 18 layers, every sixth full attention, the others a 512-token window; one KV head of 256
GEMMA_3_270M = dict(model_type="gemma3_text", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                    num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                    sliding_window=512, max_position_embeddings=32768)


def test_windowed_layers_count_their_window_only(tmp_path):
    planner = Planner(config_file(tmp_path, GEMMA_3_270M))
    parts = planner.plan("bf16", context=32768, tree_tokens=61).components
    per_token = 2 * 1 * 256 * 2  # K and V, one KV head of 256, bf16
    assert parts["target KV cache (32768 tokens; 15 of 18 layers windowed at 512)"] == (
        3 * 32768 * per_token + 15 * 512 * per_token)
    assert planner.target_kv_cache(300) == 18 * 300 * per_token  # a short context fits every window
    # the whole 32k context fits a small card: most of the KV cache stays at 512 tokens
    assert planner.plan("bf16", context=32768, tree_tokens=61, gpu_bytes=4 * GiB).longest_context == 32768


def test_planned_kv_cache_matches_a_real_cache():
    """The planner's KV bytes against what transformers' own cache holds for a hybrid windowed model."""
    config = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8)
    model = AutoModelForCausalLM.from_config(config).eval()
    cache = DynamicCache(config=config)
    with torch.no_grad():
        model(torch.randint(0, 300, (1, 40)), past_key_values=cache)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    windowed_keeps = 8 - 1  # transformers keeps the last window - 1 keys between steps; the planner counts window
    planner = Planner(config, dtype="fp32")
    assert planner.target_kv_cache(40) == held + 5 * 2 * 2 * 16 * 4 * (8 - windowed_keeps)


@pytest.mark.parametrize("config", [
    LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True),
    Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=False, use_sliding_window=False),
], ids=["llama-tied", "qwen2-biases"])
def test_predicted_sizes_match_a_real_model(config):
    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in real.parameters())  # a tied lm_head counts once
    buffers = sum(b.numel() * b.element_size() for b in real.buffers())
    meta = meta_model(config)
    assert target_weight_bytes(meta, "fp32") == 4 * params + buffers
    assert target_weight_bytes(meta, "bf16") == 2 * params + buffers
    # int8 keeps embeddings, norms, biases and lm_head in 16-bit: count them on the real model
    linears = [m for name, m in real.named_modules() if type(m) is torch.nn.Linear and name != "lm_head"]
    weights = sum(m.weight.numel() for m in linears)
    rows = sum(m.out_features for m in linears)
    assert target_weight_bytes(meta, "int8") == weights + 4 * rows + 2 * (params - weights) + buffers


def test_planned_drafter_matches_a_real_one():
    target = make_target("llama")
    drafter = make_drafter(target, eagle31=True)
    planner = Planner(target.config, dtype="fp32", draft_vocab_size=VOCAB)
    report = drafter_memory_report(drafter, target)
    assert planner.drafter_bytes == report["drafter_bytes"]


def test_drafter_memory_report_on_tiny_target():
    target = make_target("llama")  # fp32, vocab 256, hidden 64, MLP 128, 4 heads of 16, 2 KV heads, 6 layers
    drafter = make_drafter(target, eagle31=True)
    report = drafter_memory_report(drafter, target)
    # drafter params: fc 192*64, q 128*64, k/v 128*32, o 64*64, MLP 3*64*128, 7 norms of 64, lm_head 256*64
    params = 192 * 64 + 128 * 64 + 2 * 128 * 32 + 64 * 64 + 3 * 64 * 128 + 7 * 64 + 256 * 64
    assert params == 74_176 == sum(p.numel() for p in drafter.parameters())
    buffers = 8 * 256 + 256 + 2 * 8 * 4  # d2t, t2d, rotary
    assert report["drafter_bytes"] == 4 * params + buffers == 299_072
    tensors = (*drafter.parameters(), *drafter.buffers())
    assert report["drafter_bytes"] == sum(t.numel() * t.element_size() for t in tensors)
    target_params = 2 * 256 * 64 + 6 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    assert target_params == sum(p.numel() for p in target.parameters())
    assert report["target_bytes"] == 4 * target_params + 2 * 8 * 4 == 1_019_200
    assert report["embedding_shared"] and report["shared_bytes"] == 0
    assert report["percent"] == pytest.approx(100 * 299_072 / 1_019_200)


def test_drafter_memory_report_counts_shared_storage_once():
    target = make_target("llama")
    own = make_drafter(target, eagle31=False)
    own.embed_tokens = torch.nn.Embedding(VOCAB, 64)  # a private copy: the drafter pays for it
    own._target_embedding.clear()
    assert not drafter_memory_report(own, target)["embedding_shared"]
    base = drafter_memory_report(make_drafter(target, eagle31=False), target)["drafter_bytes"]
    assert drafter_memory_report(own, target)["drafter_bytes"] == base + VOCAB * 64 * 4
    shared = make_drafter(target, eagle31=False)
    shared.embed_tokens = target.get_input_embeddings()  # registered, but the target's storage
    report = drafter_memory_report(shared, target)
    assert report["drafter_bytes"] == base and report["shared_bytes"] == VOCAB * 64 * 4


@pytest.mark.parametrize("quant", ["nf4", "nf4-dq", "fp4", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_planned_bytes_match_bitsandbytes(tmp_path, arch, quant):
    """bitsandbytes' own quantized tensors (it runs on CPU since 0.48): the planner's layout must match."""
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    make_target(arch, dtype=torch.bfloat16).save_pretrained(tmp_path)
    options = (dict(load_in_8bit=True) if quant == "int8" else
               dict(load_in_4bit=True, bnb_4bit_quant_type=quant[:3], bnb_4bit_use_double_quant=quant.endswith("-dq"),
                    bnb_4bit_compute_dtype=torch.bfloat16))
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                 quantization_config=BitsAndBytesConfig(**options))
    planner = Planner(tmp_path)
    assert planner.weights(quant) == tensor_bytes(model)


def test_parse_memory():
    assert parse_memory("24GiB") == parse_memory("24") == 24 * GiB
    assert parse_memory("24 GB") == 24 * 10**9
    assert parse_memory("23034MiB") == 23034 * MiB
    with pytest.raises(ValueError, match="cannot read GPU memory"):
        parse_memory("24 gigs")


def test_cli_json_and_errors(tmp_path, capsys):
    path = config_file(tmp_path, LLAMA_31_8B)
    code = cli_main(["plan", "--target", str(path), "--gpu", "rtx4090", "--quant", "nf4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["fits"] is True and out["gpu_bytes"] == RTX_4090
    assert out["components"]["target weights (nf4)"] == 6_027_762_176
    assert out["total"] == sum(out["components"].values())
    assert cli_main(["plan", "--target", str(path), "--gpu-mem", "8GiB", "--quant", "bf16"]) == 1
    text = capsys.readouterr().out
    assert "does not fit" in text and "--quant nf4-dq fits a context of at most" in text
    assert cli_main(["plan", "--target", str(path), "--gpu", "gtx480"]) == 2
    assert "unknown GPU 'gtx480'" in capsys.readouterr().err
    assert cli_main(["plan", "--target", str(tmp_path / "missing")]) == 2
    assert f"no such folder: {tmp_path / 'missing'}" in capsys.readouterr().err
