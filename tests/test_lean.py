"""The lean verify forward of a Llama target (hf_eagle31/backends/cpu/lean.py) against transformers' own forward."""

import copy
import gc
import math
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from tiny_models import _COMMON, PROMPTS, make_target, trained_pair
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM

import hf_eagle31
from hf_eagle31.backends import fast_bf16
from hf_eagle31.backends.cpu import lean as llama_verify
from hf_eagle31.backends.cpu import products as products_module
from hf_eagle31.backends.cpu import routes, rows
from hf_eagle31.backends.cpu.products import Products, can_pack, packed_product
from hf_eagle31.backends.cpu.rows import MAX_ROWS
from hf_eagle31.bench.batching import left_padded
from hf_eagle31.compat import CACHE_KWARG
from hf_eagle31.generation import eagle_verification
from hf_eagle31.cache import compact_cache
from hf_eagle31.verification import verify_forward
from hf_eagle31.verify_plan import VerifyPlan

pytestmark = pytest.mark.skipif(not can_pack(make_target()), reason="oneDNN packed linears need a CPU build with mkldnn")

LAYER_IDS = [1, 3, 6]  # 6: the last, the final norm's output (transformers' last hidden state)
TREE = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)


def prefilled(target, prompts, attention_mask, tree):
    """The target's cache after `prompts` and the plan of a verify block shaped `tree` after them."""
    cache = DynamicCache(config=target.config)
    target(prompts, attention_mask=attention_mask, **{CACHE_KWARG: cache})
    plan = VerifyPlan.for_cache(tree.expand(len(prompts), -1, -1), cache, "batched", attention_mask.bool(),
                                prompts.shape[1], len(prompts))
    return cache, plan


def both_forwards(target, prompts, attention_mask):
    """The same verify block after the same prefix, through transformers' forward and the lean one, with the
    caches each left behind."""
    results = []
    for lean in (False, True):
        with torch.no_grad(), eagle_verification(target):
            products = Products(target)
            cache, plan = prefilled(target, prompts, attention_mask, TREE)
            assert llama_verify.fits(target, products) and llama_verify.fits_step(cache, plan)
            tokens = torch.tensor([[5, 9, 17, 33, 65]]).expand(len(prompts), -1)
            positions = attention_mask.sum(-1, keepdim=True) + torch.tensor([[0, 1, 1, 2, 2]])
            with products.active(mode=not lean):
                if lean:
                    room = llama_verify.room_for(target, products)
                    room.norms = None  # the layers on torch's ops (computed whole by the library: a rounding apart)
                    logits, features = llama_verify.llama_verify_forward(target, cache, room, plan, tokens, positions,
                                                                         LAYER_IDS)
                else:
                    logits, features = verify_forward(target, cache, plan, tokens, positions, LAYER_IDS)
            results.append((logits, features, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]))
    return results


def perturbed_copy(target):
    """Another target of the same class, carrying the original's module attributes, with other weights."""
    other = copy.deepcopy(target)
    with torch.no_grad():
        for weight in other.parameters():
            weight.add_(0.05 * torch.randn_like(weight))
    return other


def kernel_routes(monkeypatch, dtype: torch.dtype) -> None:
    """Every row count of `dtype` on the rows kernel, whatever this machine measured (at 1 thread an AMD EPYC sends
    3-16 fp32 rows to oneDNN): the kernel multiplies any count exactly, and the library's whole forward runs only on
    it. Skipped where the library is not built or does not multiply `dtype`."""
    if "rows" not in routes.available(dtype):
        pytest.skip(f"the rows kernel does not multiply {dtype} here")
    monkeypatch.setitem(routes._ROUTES, (dtype, torch.get_num_threads()), ("rows",) * len(routes.COUNTS))


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])  # qwen2: q/k/v with biases
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
def test_the_lean_forward_equals_transformers_forward_bit_for_bit(arch, dtype, tied):
    if dtype == torch.bfloat16 and not fast_bf16(torch.device("cpu")):
        pytest.skip("bf16 weights are packed only where oneDNN computes bf16")
    target = make_target(arch, seed=7, dtype=dtype)
    if tied:
        target.lm_head.weight = target.model.embed_tokens.weight
    prompts = PROMPTS[:2, :12]
    attention_mask = torch.ones_like(prompts)
    attention_mask[1, :3] = 0  # a left-padded row
    (logits, features, cache), (lean_logits, lean_features, lean_cache) = both_forwards(
        target, prompts, attention_mask)
    assert logits.dtype == torch.float32 and features.shape == (2, 5, 3 * target.config.hidden_size)
    assert torch.equal(lean_logits, logits)
    assert torch.equal(lean_features, features)
    assert all(torch.equal(a, b) for layer, lean_layer in zip(cache, lean_cache) for a, b in zip(layer, lean_layer))


def test_only_targets_it_computes_exactly_take_the_lean_forward():
    """Another architecture or a sliding window, weights not packed, a hook, another verify mode: transformers'
    forward."""
    target = make_target(seed=7)
    prompts = PROMPTS[:1, :8]

    def fits(model):
        with torch.no_grad(), eagle_verification(model):
            model(prompts, output_hidden_states=[1])  # transformers leaves its (inert) capturing hooks behind
            return llama_verify.fits(model, Products(model))

    assert fits(target)
    assert fits(make_target("qwen2")) and fits(make_target("mistral"))
    assert not fits(MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=4)).eval())
    assert not fits(GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4)).eval())
    for module in (target, target.model.layers[2].mlp, target.model.layers[0].self_attn.k_proj, target.model.norm):
        handle = module.register_forward_hook(lambda *args: None)
        assert not fits(target)
        handle.remove()
    up = target.model.layers[1].mlp.up_proj
    up.forward = lambda x: torch.nn.Linear.forward(up, x)  # a user's patch: the lean forward would step over it
    assert not fits(target)
    del target.model.layers[1].mlp.up_proj.forward
    assert fits(target)
    cache = DynamicCache(config=target.config)
    target(prompts, **{CACHE_KWARG: cache})
    assert llama_verify.fits_step(cache, VerifyPlan.for_cache(TREE[None], cache, "batched"))
    assert not llama_verify.fits_step(cache, VerifyPlan.for_cache(TREE[None], cache, "exact"))


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_decoding_takes_the_lean_forward_and_still_equals_plain_greedy(monkeypatch, arch):
    target, drafter = trained_pair(arch, tree_depth=3, tree_top_k=3, tree_total_tokens=6)
    calls = []
    lean_forward = llama_verify.llama_verify_forward
    monkeypatch.setattr(llama_verify, "llama_verify_forward", lambda *args: calls.append(1) or lean_forward(*args))
    plain = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=24)
    eagle = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=24, assistant_model=drafter)
    assert calls and torch.equal(eagle, plain)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decoding_on_forwards_computed_whole_by_the_rows_library_equals_plain_greedy(monkeypatch, arch):
    """Verify blocks and one-token steps computed whole (rows_step.cpp), a batch with a left pad included: the same
    tokens as plain greedy `generate` (fp32)."""
    target, drafter = trained_pair(arch, tree_depth=3, tree_top_k=3, tree_total_tokens=6)
    kernel_routes(monkeypatch, torch.float32)
    blocks = []
    whole_step = llama_verify._whole_step
    monkeypatch.setattr(llama_verify, "_whole_step", lambda *args: blocks.append(args[2].shape[1]) or whole_step(*args))
    batch = left_padded([PROMPTS[0, :9].tolist(), PROMPTS[1, :5].tolist()], 0, "cpu")
    for inputs in ({"input_ids": PROMPTS[:1]}, batch):
        plain = target.generate(**inputs, do_sample=False, max_new_tokens=24)
        eagle = target.generate(**inputs, do_sample=False, max_new_tokens=24, assistant_model=drafter)
        assert torch.equal(eagle, plain)
    assert blocks and max(blocks) > 1


def test_fast_decoding_takes_the_lean_forward_one_token_a_step_and_equals_plain_greedy(monkeypatch):
    """`fast_decoding` is the plain baseline EAGLE is measured against: its steps must run on the forward EAGLE
    verifies with, one token each, computed whole by the rows library where it multiplies one row (rows_step.cpp)."""
    target, _ = trained_pair("llama")
    blocks = []
    lean_forward = llama_verify.llama_verify_forward
    monkeypatch.setattr(llama_verify, "llama_verify_forward",
                        lambda *args: blocks.append(args[4].shape[1]) or lean_forward(*args))
    plain = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fast = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=16,
                               custom_generate=hf_eagle31.fast_decoding)
    assert torch.equal(fast, plain) and blocks == [1] * 15  # the prefill's forward emits the first token
    whole = {event.key: event.count for event in profile.key_averages()}.get("hf_eagle31_rows::step", 0)
    library = rows.attends(target.model.layers[0].self_attn.head_dim) and routes.on_kernel(1, target.dtype)
    assert whole == (15 if library else 0)


def test_a_whole_forward_holds_the_weights_while_its_call_lasts_and_lets_them_go(monkeypatch):
    """The rows library looks a call's weights up at its first whole forward and holds them for the rest
    (rows_step.cpp's `prepared_for`): a weight replaced between calls is the one the next call multiplies by (plain
    greedy's output), and once the call is over the library holds no weight the model let go of."""
    kernel_routes(monkeypatch, torch.float32)
    target = make_target("llama")
    steps = []
    whole_step = llama_verify._whole_step
    monkeypatch.setattr(llama_verify, "_whole_step", lambda *args: steps.append(1) or whole_step(*args))
    step, fast = dict(do_sample=False, max_new_tokens=12), dict(custom_generate=hf_eagle31.fast_decoding)
    assert torch.equal(target.generate(PROMPTS[:1, :4], **step, **fast), target.generate(PROMPTS[:1, :4], **step))
    down = target.model.layers[1].mlp.down_proj
    old = weakref.ref(down.weight)
    torch.manual_seed(0)
    with torch.no_grad():
        down.weight = torch.nn.Parameter(down.weight + torch.randn_like(down.weight) * 0.5)
    gc.collect()
    assert old() is None, "the library still holds a weight of a call that is over"
    plain = target.generate(PROMPTS[:1, :4], **step)
    assert torch.equal(target.generate(PROMPTS[:1, :4], **step, **fast), plain) and len(steps) == 22


def test_two_calls_at_once_multiply_by_their_own_models_weights(monkeypatch):
    """A call inside another (from its streamer, as another thread's would run beside it) on another model: each
    call's whole forwards multiply by its own model's weights (plain greedy's output for both)."""
    kernel_routes(monkeypatch, torch.float32)
    outer, inner = make_target("llama"), make_target("llama")
    torch.manual_seed(1)
    with torch.no_grad():
        for weight in inner.parameters():
            weight.add_(torch.randn_like(weight) * 0.3)
    step, fast = dict(do_sample=False, max_new_tokens=12), dict(custom_generate=hf_eagle31.fast_decoding)
    puts, inside = [], []

    class Streamer:
        def put(self, tokens):
            puts.append(tokens)
            if len(puts) in (3, 4):  # the prompt, the prefill's token, then tokens of the outer call's whole steps
                inside.append(inner.generate(PROMPTS[:1, :4], **step, **fast))

        def end(self):
            pass

    outer_tokens = outer.generate(PROMPTS[:1, :4], **step, **fast, streamer=Streamer())
    assert torch.equal(outer_tokens, outer.generate(PROMPTS[:1, :4], **step))
    plain = inner.generate(PROMPTS[:1, :4], **step)
    assert not torch.equal(plain, outer_tokens) and len(inside) == 2
    assert all(torch.equal(tokens, plain) for tokens in inside)


def lean_forward(target, whole: bool, block: bool, head: bool = True):
    """A verify forward of a left-padded batch of two after its prompts, a tree block (`TREE`) or one token a row,
    through the lean forward with its layers computed whole by the rows library (`whole`) or on torch's ops, the
    library multiplying by the LM head where the room says so (`head`) or the head's own call; its logits, features
    and the cache it leaves."""
    prompts = PROMPTS[:2, :12]
    attention_mask = torch.ones_like(prompts)
    attention_mask[1, :3] = 0
    tree = TREE if block else torch.ones(1, 1, dtype=torch.bool)
    tokens = torch.tensor([[5, 9, 17, 33, 65][: len(tree)], [9, 5, 65, 17, 33][: len(tree)]])
    positions = attention_mask.sum(-1, keepdim=True) + torch.tensor([[0, 1, 1, 2, 2][: len(tree)]])
    with torch.no_grad(), eagle_verification(target):
        products = Products(target)
        cache, plan = prefilled(target, prompts, attention_mask, tree)
        with products.active(mode=False):
            room = llama_verify.room_for(target, products)
            if not whole:
                room.norms = None
            if not head:
                room.head = None
            logits, features = llama_verify.llama_verify_forward(target, cache, room, plan, tokens, positions,
                                                                 LAYER_IDS)
    return logits, features, [(layer.keys, layer.values) for layer in cache.layers]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases, which the products add
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [False, True])
def test_a_forward_computed_whole_by_the_rows_library_is_the_lean_forwards_to_a_rounding(monkeypatch, arch, dtype,
                                                                                         block):
    """rows_step.cpp computes a forward's norms, rotary turn, attention, gated MLP and residual adds between its
    products in one call (`_whole_step`), for one token a row or a tree block: the logits, features (the final
    norm's included) and cache of the lean forward on torch's ops, but for the order of a few sums (a bf16 rounding
    here and there in bf16)."""
    target = make_target(arch, seed=11, dtype=dtype)
    kernel_routes(monkeypatch, dtype)
    if not rows.attends(target.model.layers[0].self_attn.head_dim):
        pytest.skip("the rows library does not attend over these heads here")
    whole_steps = []
    whole_step = llama_verify._whole_step
    monkeypatch.setattr(llama_verify, "_whole_step", lambda *args: whole_steps.append(1) or whole_step(*args))
    (logits, features, cache), (whole_logits, whole_features, whole_cache) = (
        lean_forward(target, whole, block) for whole in (False, True))
    assert whole_steps == [1]
    # of the largest magnitude; measured 7e-7 in fp32, in bf16 0 for a token and 1.8% for a block, whose SDPA rounds
    # its bf16 probabilities where the library's attention keeps them in fp32 (both as far from fp32's logits)
    tolerance = 1e-5 if dtype == torch.float32 else 4e-2
    cached = [(a, b) for layer, whole_layer in zip(cache, whole_cache) for b, a in zip(layer, whole_layer)]
    for got, expected in ((whole_logits, logits), (whole_features, features), *cached):
        assert got.shape == expected.shape
        assert (got.float() - expected.float()).abs().max() <= tolerance * expected.float().abs().max()
    if dtype == torch.float32:  # in bf16 a near tie may flip, as between any two bf16 paths
        assert torch.equal(whole_logits.argmax(-1), logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [False, True])
def test_a_forward_computed_whole_gives_the_same_bits_on_any_number_of_threads(monkeypatch, dtype, block):
    """rows_step.cpp runs a forward on every thread of one parallel region, the products, attention and gate split
    among them and the rest computed by each: on one thread nothing is split, three split each product and the gate
    unevenly (and leave one idle in the attention over the tiny model's two key/value heads), yet each output is
    summed by one thread in one order."""
    target = make_target("llama", seed=11, dtype=dtype)
    if not rows.attends(target.model.layers[0].self_attn.head_dim):
        pytest.skip("the rows library does not attend over these heads here")
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            kernel_routes(monkeypatch, dtype)
            outputs.append(lean_forward(target, True, block))
    finally:
        torch.set_num_threads(threads)
    (logits, features, cache), (split_logits, split_features, split_cache) = outputs
    assert torch.equal(split_logits, logits) and torch.equal(split_features, features)
    assert all(torch.equal(a, b) for layer, split in zip(cache, split_cache) for a, b in zip(layer, split))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_a_forward_computed_whole_multiplies_by_the_lm_head_as_its_own_call_would(monkeypatch, dtype, block, tied):
    """The library multiplies a whole forward's states by the LM head too (`CacheRoom.head`): the logits of the
    head's own call, bit for bit. A head whose call would do more (a hook) is called: the hook sees the forward."""
    target = make_target("llama", seed=11, dtype=dtype)
    if tied:
        target.lm_head.weight = target.model.embed_tokens.weight
    kernel_routes(monkeypatch, dtype)
    if not rows.attends(target.model.layers[0].self_attn.head_dim):
        pytest.skip("the rows library does not attend over these heads here")
    heads = []
    room_for = llama_verify.room_for

    def recorded(*args):  # each room's head, the room itself handed on
        room = room_for(*args)
        heads.append(room.head)
        return room

    monkeypatch.setattr(llama_verify, "room_for", recorded)
    called, in_library = (lean_forward(target, True, block, head) for head in (False, True))
    assert heads[1] is target.lm_head
    assert all(torch.equal(a, b) for a, b in zip(called[:2], in_library[:2]))
    seen = []
    hook = target.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    try:
        hooked = lean_forward(target, True, block)
    finally:
        hook.remove()
    assert heads[2] is None and len(seen) == 2 and seen[-1] == hooked[0].shape  # the prefill's, then the block's
    assert torch.equal(hooked[0], called[0])


def test_a_step_is_computed_whole_only_for_mlps_gated_by_silu():
    """rows_step.cpp computes SiLU's gate: another activation takes the lean forward on torch's ops."""
    target = make_target(seed=5)
    assert llama_verify._norms(target.model) is not None
    for layer in target.model.layers[:1]:
        layer.mlp.act_fn = torch.nn.GELU()
    assert llama_verify._norms(target.model) is None
    fast = target.generate(PROMPTS[:1, :6], do_sample=False, max_new_tokens=12,
                           custom_generate=hf_eagle31.fast_decoding)
    assert torch.equal(fast, target.generate(PROMPTS[:1, :6], do_sample=False, max_new_tokens=12))


def test_the_cache_room_grows_the_cache_as_concatenation_does_without_copying_it():
    """Blocks appended, rolled back (by the room's `truncate`), compacted, a row leaving: the room's cache holds what
    transformers' holds, grows in place between buffers, and never writes into a tensor handed out before the room
    was made."""
    torch.manual_seed(0)
    batch, heads, size = 2, 3, 8
    caches = [DynamicCache(), DynamicCache()]
    prefix = torch.randn(batch, heads, 10, size), torch.randn(batch, heads, 10, 4)  # values of another head size
    for cache in caches:
        cache.update(*prefix, 0)
        cache.crop(-2)
    kept_before = caches[1].layers[0].keys  # the front of the prefix's tensor: the room must copy, not write into it
    held = kept_before.clone()
    room = llama_verify.CacheRoom([])  # the cache alone: no forward, no products
    moves = 0
    for step in range(40):
        n = 1 + step % 5
        block = torch.randn(batch, heads, n, size), torch.randn(batch, heads, n, 4)
        expected = caches[0].update(*block, 0)
        pointer = caches[1].layers[0].keys.data_ptr()
        (keys,), (values,), length = room.reserve(caches[1], n)  # as the lean forward writes a block
        keys[:, :, length:], values[:, :, length:] = block
        room.commit(caches[1], length + n)
        moves += caches[1].layers[0].keys.data_ptr() != pointer
        layer = caches[1].layers[0]
        assert torch.equal(layer.keys, expected[0]) and torch.equal(layer.values, expected[1])
        start = caches[0].get_seq_length() - n
        kept = [torch.arange(n)[torch.randperm(n)[: 1 + step % n]].sort().values for _ in range(batch)]
        compact_cache(caches[0], start, kept)
        compact_cache(caches[1], start, kept, room.truncate)  # the room's tensors cut in place
        if step == 30:
            for cache in caches:
                cache.batch_select_indices(torch.tensor([1]))
            batch = 1
        (keys, values), (room_keys, room_values) = ((c.layers[0].keys, c.layers[0].values) for c in caches)
        assert torch.equal(room_keys, keys) and torch.equal(room_values, values)
    assert torch.equal(kept_before, held) and kept_before.shape == held.shape
    assert moves <= 4  # the first block, the row leaving, and a new buffer when the room runs out


def test_the_cache_room_grows_the_tensors_it_gave_in_place_and_no_others():
    """Where the rows library is loaded, `commit` grows and `truncate` cuts the layer's tensors the room gave it in
    place (no new views a step); a tensor taken from the cache before, or one transformers made (a crop), keeps its
    shape."""
    cache = DynamicCache()
    cache.update(torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4), 0)
    before = cache.layers[0].keys
    room = llama_verify.CacheRoom([])
    shapes = []
    for step in range(3):
        _, _, length = room.reserve(cache, 1, views=False)
        room.commit(cache, length + 1)
        shapes.append((cache.layers[0].keys, cache.layers[0].keys.shape[2]))
    assert before.shape[2] == 6 and [length for _, length in shapes] == [7, 8, 9]
    if rows.rows_kernel():
        assert shapes[0][0] is shapes[1][0] is shapes[2][0]  # grown in place
    room.truncate(cache, 8)  # cut in place where the library is loaded, as transformers' crop would cut
    assert cache.layers[0].keys.shape[2] == 8 and before.shape[2] == 6
    if rows.rows_kernel():
        assert cache.layers[0].keys is shapes[2][0]
    cache.crop(-1)
    cropped = cache.layers[0].keys
    room.truncate(cache, 9)  # longer than the cache: nothing to cut
    assert cache.layers[0].keys is cropped
    _, _, length = room.reserve(cache, 2, views=False)
    room.commit(cache, length + 2)
    assert cropped.shape[2] == 7 and cache.layers[0].keys.shape[2] == 9
    assert torch.equal(cache.layers[0].keys[:, :, :7], cropped)
    room.truncate(cache, 8)  # the tensors commit gave it, cut again
    assert cache.layers[0].keys.shape[2] == 8 and torch.equal(cache.layers[0].keys[:, :, :7], cropped)


def test_the_compiled_lean_forward_decodes_as_plain_greedy_and_compiles_once(monkeypatch):
    """`compile_verify`: inductor's graph of the lean forward gives plain greedy's output (fp32), and serves every
    later call, its new packing of the weights, other block sizes and cache lengths, without compiling again."""
    target, drafter = trained_pair("llama", tree_depth=3, tree_top_k=3, tree_total_tokens=6, compile_verify=True)
    calls = []
    compiled = llama_verify.compiled_decoder()
    monkeypatch.setattr(llama_verify, "compiled_decoder", lambda: lambda *args: calls.append(1) or compiled(*args))
    plain = target.generate(PROMPTS[:1, :4], do_sample=False, max_new_tokens=24)
    eagle = target.generate(PROMPTS[:1, :4], do_sample=False, max_new_tokens=24, assistant_model=drafter)  # compiles
    assert calls and torch.equal(eagle, plain)
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = target.generate(PROMPTS[1:2], do_sample=False, max_new_tokens=40, assistant_model=drafter)
    assert len(calls) > 1 and torch.equal(again, target.generate(PROMPTS[1:2], do_sample=False, max_new_tokens=40))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, :2] = 0  # a left-padded row: a batch compiles its own graph, rows leaving it reuse that one
    batch = target.generate(PROMPTS[2:5], attention_mask=mask, do_sample=False, max_new_tokens=20,
                            assistant_model=drafter)
    assert torch.equal(batch, target.generate(PROMPTS[2:5], attention_mask=mask, do_sample=False, max_new_tokens=20))
    # the graph names each packed product by its layer's key: another target of the class gets a graph of its own
    other = perturbed_copy(target)
    own = other.generate(PROMPTS[:1, :4], do_sample=False, max_new_tokens=24)
    assert not torch.equal(own, plain)  # the weights differ where it shows
    assert torch.equal(other.generate(PROMPTS[:1, :4], do_sample=False, max_new_tokens=24, assistant_model=drafter), own)


def test_fast_decoding_compiles_its_one_token_steps_and_decodes_as_plain_greedy(monkeypatch):
    """`compile_step=True`: fast_decoding's steps run inductor's graph of the lean forward (one graph for every
    later call and context length) and give plain greedy's output (fp32); where the lean forward does not serve
    the target, it says so and runs eagerly."""
    target = make_target()
    calls = []
    compiled = llama_verify.compiled_decoder()
    monkeypatch.setattr(llama_verify, "compiled_decoder", lambda: lambda *args: calls.append(1) or compiled(*args))
    for prompt, new in ((PROMPTS[:1, :4], 24), (PROMPTS[1:2], 40)):
        plain = target.generate(prompt, do_sample=False, max_new_tokens=new)
        with torch._dynamo.config.patch(error_on_recompile=len(calls) > 0):
            fast = target.generate(prompt, do_sample=False, max_new_tokens=new, custom_generate=hf_eagle31.fast_decoding,
                                   compile_step=True)
        assert torch.equal(fast, plain)
    assert len(calls) == 24 - 1 + 40 - 1  # every step but the prefill's first token
    target.generate(PROMPTS[:1, :4], do_sample=False, max_new_tokens=8, custom_generate=hf_eagle31.fast_decoding)
    assert len(calls) == 24 - 1 + 40 - 1  # eager unless asked
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=_COMMON["vocab_size"])).eval()
    with pytest.warns(UserWarning, match="compile_step=True.*runs eagerly"):
        out = gpt2.generate(PROMPTS[:1, :4], do_sample=False, max_new_tokens=8,
                            custom_generate=hf_eagle31.fast_decoding, compile_step=True)
    assert torch.equal(out, gpt2.generate(PROMPTS[:1, :4], do_sample=False, max_new_tokens=8))


def test_a_compiled_step_multiplies_by_the_weights_the_model_holds_at_each_call():
    """The compiled graph names its products by key and the rows library holds their weights
    (`CacheRoom.hold_weights`), once a call: a weight replaced or edited between calls is the one the next call
    multiplies by (fp32, plain greedy's output after each edit), and the graph is not compiled again."""
    if not routes.on_kernel(1, torch.float32):
        pytest.skip("the rows kernel does not multiply one fp32 row on this machine")
    target = make_target("qwen2")  # biases too
    step = dict(do_sample=False, max_new_tokens=12)
    fast = dict(custom_generate=hf_eagle31.fast_decoding, compile_step=True)
    assert torch.equal(target.generate(PROMPTS[:1, :4], **step, **fast), target.generate(PROMPTS[:1, :4], **step))
    layer, noise = target.model.layers[1], lambda tensor: torch.randn_like(tensor) * 0.5
    torch.manual_seed(0)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        down, v, q = layer.mlp.down_proj, layer.self_attn.v_proj, layer.self_attn.q_proj
        for edit in (lambda: setattr(down, "weight", torch.nn.Parameter(noise(down.weight))),  # replaced
                     lambda: v.bias.add_(noise(v.bias)), lambda: q.weight.add_(noise(q.weight))):  # in place
            before = target.generate(PROMPTS[:1, :4], **step)
            edit()
            plain = target.generate(PROMPTS[:1, :4], **step)
            assert not torch.equal(plain, before)
            assert torch.equal(target.generate(PROMPTS[:1, :4], **step, **fast), plain)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # Qwen2: q/k/v biases, added by the kernel
def test_a_compiled_one_token_step_runs_on_the_rows_kernel_without_calling_back_into_python(monkeypatch, arch):
    """Where the rows kernel serves one row, fast_decoding's compiled step calls it from the graph on the layers' own
    weights (no product goes through the Python op, `packed_product`) and attends with its library's attention
    (not SDPA's), and the output is plain greedy's (fp32)."""
    if not routes.on_kernel(1, torch.float32):
        pytest.skip("the rows kernel does not multiply one fp32 row on this machine")
    target = make_target(arch)
    calls, original = [], products_module.packed_product
    monkeypatch.setattr(products_module, "packed_product", lambda *args: calls.append(1) or original(*args))
    plain = target.generate(PROMPTS[:1, :4], do_sample=False, max_new_tokens=16)
    step = dict(do_sample=False, max_new_tokens=16, custom_generate=hf_eagle31.fast_decoding, compile_step=True)
    target.generate(PROMPTS[:1, :4], **step)  # compiled before the profile below
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fast = target.generate(PROMPTS[:1, :4], **step)
    assert torch.equal(fast, plain) and not calls
    attended = {event.key: event.count for event in profile.key_averages()}.get("hf_eagle31_rows::attention_in_room", 0)
    assert attended == 15 * target.config.num_hidden_layers  # every step after the prefill's first token


def test_a_compiled_one_token_step_masks_a_batchs_pads_as_plain_greedy_does():
    """Left-padded rows of a batch: the compiled step's attention (the rows library's, where it serves) hides each
    row's pads by the additive mask, so every row equals plain batched greedy's (fp32)."""
    if not routes.on_kernel(3, torch.float32):
        pytest.skip("the rows kernel does not multiply three fp32 rows on this machine")
    target = make_target()
    batch = left_padded([PROMPTS[0].tolist(), PROMPTS[1, :2].tolist(), PROMPTS[2, :4].tolist()], 0, "cpu")
    plain = target.generate(**batch, do_sample=False, max_new_tokens=12, pad_token_id=0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fast = target.generate(**batch, do_sample=False, max_new_tokens=12, pad_token_id=0,
                               custom_generate=hf_eagle31.fast_decoding, compile_step=True)
    assert torch.equal(fast, plain)
    assert any(event.key == "hf_eagle31_rows::attention_in_room" for event in profile.key_averages())


def test_a_compiled_verify_block_runs_on_the_rows_kernel_without_calling_back_into_python():
    """Where the rows kernel serves every row count, `compile_verify`'s graph multiplies its blocks on it, those of
    a batch past `MAX_ROWS` rows too (3 rows of 7-token trees), not through the Python op `hf_eagle31::packed_linear`,
    and decodes as plain batched greedy (fp32)."""
    if not routes.serves_every_count(torch.float32):
        pytest.skip("the rows kernel does not multiply every fp32 row count on this machine")
    target, drafter = trained_pair("llama", tree_depth=3, tree_top_k=3, tree_total_tokens=6, compile_verify=True)
    batch = left_padded([PROMPTS[0].tolist(), PROMPTS[1, :2].tolist(), PROMPTS[2, :4].tolist()], 0, "cpu")
    step = dict(do_sample=False, max_new_tokens=16, pad_token_id=0)
    plain = target.generate(**batch, **step)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
        eagle = target.generate(**batch, **step, assistant_model=drafter)  # compiles, then runs
    assert torch.equal(eagle, plain)
    assert not any(event.name == "hf_eagle31::packed_linear" for event in profile.events())
    multiplied = [math.prod(event.input_shapes[0][:-1]) for event in profile.events()
                  if event.name == "hf_eagle31_rows::product" and event.input_shapes and event.input_shapes[0]]
    assert max(multiplied) > MAX_ROWS  # a block of the batch past the measured row counts went to the kernel


KEYS_OF_A_FRESH_PROCESS = """
import sys; sys.path.insert(0, sys.argv[1])
from tiny_models import make_target
from hf_eagle31.backends.cpu import lean
from hf_eagle31.backends.cpu.products import Products
target = make_target()
Products(target)
print(lean.product_keys(target.model))
"""


def test_two_processes_name_the_products_alike_so_inductor_finds_the_graph_another_compiled():
    """The compiled verify graph holds its products' keys as constants: keys that differ between processes (the
    modules' ids) made every process compile the graph again (~110 s for SmolLM2) instead of loading it from
    inductor's cache."""
    keys = [subprocess.run([sys.executable, "-c", KEYS_OF_A_FRESH_PROCESS, str(Path(__file__).parent)], check=True,
                           capture_output=True, text=True).stdout.strip().splitlines()[-1] for _ in range(2)]
    assert keys[0] == keys[1]


def test_a_copied_target_packed_beside_its_original_draws_keys_of_its_own():
    """A copy is another module: the two must not share a key, or a compiled lean forward of one would multiply by
    the other's weights."""
    target = make_target(seed=3)
    Products(target)  # its keys drawn
    other = perturbed_copy(target)
    attention = target.model.layers[0].self_attn
    x = torch.randn(3, attention.q_proj.in_features)
    with torch.no_grad():
        expected = torch.cat([attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)], dim=-1)
        products = Products(target)
        Products(other)
        keys, other_keys = (llama_verify.product_keys(model.model) for model in (target, other))
        with products.active():
            got = packed_product(keys[0], x, expected.shape[-1])
    assert not set(keys) & set(other_keys)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
