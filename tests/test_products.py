"""The CPU backend's products (hf_eagle31/backends/cpu/products.py): made from a model's weights, held beside it,
computing what its layers' own calls compute; the model itself never changes."""

import contextlib
import copy

import pytest
import torch
from tiny_models import PROMPTS, make_drafter, make_target, trained_pair
from transformers import LlamaConfig, LlamaForCausalLM

import hf_eagle31  # noqa: F401  (routes generate(assistant_model=<EAGLE drafter>))
from hf_eagle31.backends.cpu import products as cpu_products
from hf_eagle31.backends.cpu import routes
from hf_eagle31.backends.cpu.products import Product, Products, can_pack, hold_products, products_for
from hf_eagle31.backends.cpu.rows import rows_kernel
from hf_eagle31.training.capacity import add_decoder_layers

original = Product.whole

pytestmark = pytest.mark.skipif(not can_pack(make_target()), reason="oneDNN packed linears need a CPU build with mkldnn")


@pytest.fixture(params=["onednn", "rows"])
def layout(request, monkeypatch):
    """oneDNN's reordered copies, and (on an AVX-512 CPU) the rows kernel over the weights as they are, for every
    row count (bf16 on oneDNN's where the kernel has no bf16)."""
    if request.param == "rows" and not rows_kernel():
        pytest.skip("the rows kernel needs a CPU with AVX-512 and a C++ compiler")
    monkeypatch.setattr(routes, "routes", lambda dtype: (
        request.param if request.param in routes.available(dtype) else "onednn",) * len(routes.COUNTS))
    return request.param


def snapshot(model):
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def unchanged(model, before) -> bool:
    return all(torch.equal(before[name], t) for name, t in snapshot(model).items()) and not any(
        "forward" in vars(m) for m in model.modules())


def test_products_compute_what_the_layers_compute_and_leave_the_model_alone(layout):
    target = make_target(seed=3)
    before = snapshot(target)
    reference = target(PROMPTS[:2, :9]).logits
    products = Products(target)
    assert len(products.by_key) == 4 * target.config.num_hidden_layers + 1  # q/k/v, o, gate/up, down a layer; head
    with products.active(mode=True):
        logits = target(PROMPTS[:2, :9]).logits
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
    assert unchanged(target, before) and torch.equal(target(PROMPTS[:2, :9]).logits, reference)
    # the kernel reads the weights as they are: no copy
    assert all((p.weight is None) == (layout == "rows") for p in products.by_key.values())


def test_siblings_are_one_product_and_each_takes_its_own_output():
    """q/k/v and gate/up are one product: the first asked computes all, the others take theirs; asked with another
    input, or the same one changed in place since, a sibling computes again."""
    target = make_target(seed=5)
    attention = target.model.layers[0].self_attn
    x = torch.randn(1, 3, target.config.hidden_size)
    expected = {name: getattr(attention, name)(x) for name in ("q_proj", "k_proj", "v_proj")}
    products = Products(target)
    group = products.of(attention.q_proj, attention.k_proj, attention.v_proj)
    assert group is not None and products.of(attention.k_proj, attention.q_proj) is None
    assert group.sizes == [m.out_features for m in (attention.q_proj, attention.k_proj, attention.v_proj)]
    with products.active(mode=True):
        for order in (("q_proj", "k_proj", "v_proj"), ("v_proj", "q_proj", "k_proj")):
            for name in order:
                assert torch.allclose(getattr(attention, name)(x), expected[name], atol=1e-5, rtol=1e-4)
            assert group.pending is None  # all taken: nothing held
        attention.q_proj(x)
        x.mul_(2)  # the same tensor, other values: k must not come from the product before
        assert torch.allclose(attention.k_proj(x), 2 * expected["k_proj"], atol=1e-5, rtol=1e-4)
        assert torch.allclose(attention.k_proj(x / 2), expected["k_proj"], atol=1e-5, rtol=1e-4)


def tied_model(dtype=torch.float32):
    config = LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval().to(dtype)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tied_head_is_multiplied_by_its_product_and_the_embedding_keeps_its_weight(dtype, layout):
    model = tied_model(dtype)
    ids = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 23, 999]])
    reference = model(ids).logits
    products = Products(model)
    assert products.of(model.lm_head) is not None
    with products.active(mode=True):
        logits = model(ids).logits
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(logits, reference, atol=tolerance, rtol=tolerance)
    assert model.lm_head.weight is model.model.embed_tokens.weight and torch.isfinite(model.lm_head.weight).all()


@pytest.mark.parametrize("layers", [1, 2])
def test_the_drafter_takes_one_product_per_sibling_group_and_a_hooked_layer_runs_as_a_module(layers, monkeypatch):
    target, drafter = trained_pair("llama", eagle31=True)
    drafter = copy.deepcopy(drafter)  # the fitted pair is shared by the tests: grow a copy
    add_decoder_layers(drafter, layers)
    ids, features = PROMPTS[:2, :6], torch.randn(2, 6, 3 * target.config.hidden_size)
    with torch.no_grad():
        reference = drafter(ids, features)
        calls = []
        monkeypatch.setattr(Product, "whole", lambda product, x: calls.append(x) or original(product, x))
        products = Products(drafter)
        packed = drafter(ids, features, products=products)
        assert len(calls) == 2 + 4 * layers  # fc, the head; q/k/v, o, gate/up, down in each layer
        seen = []
        hook = drafter.midlayer.self_attn.k_proj.register_forward_hook(lambda m, args, out: seen.append(out.shape))
        hooked = drafter(ids, features, products=products)
        hook.remove()
    torch.testing.assert_close(packed.logits, reference.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(packed.hidden_states, reference.hidden_states, atol=1e-4, rtol=1e-4)
    assert seen == [torch.Size([2, 6, drafter.midlayer.self_attn.k_proj.out_features])]
    torch.testing.assert_close(hooked.logits, reference.logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_on_the_cpu_backend_equals_plain_generate_and_leaves_both_models_alone(mode, layout):
    target, drafter = trained_pair("llama", eagle31=True)
    drafter.generation_config.update(speculation_mode=mode, cpu_backend=True)
    before, drafter_before = snapshot(target), snapshot(drafter)
    for prompt in (PROMPTS[0:1], PROMPTS[3:4]):
        expected = target.generate(prompt, do_sample=False, max_new_tokens=24)
        assert torch.equal(target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=24), expected)
    assert drafter.speculation_stats.speculative_forwards > 0
    assert unchanged(target, before) and unchanged(drafter, drafter_before)


def test_a_serving_loop_makes_the_products_once_and_the_model_saves_and_trains_inside(monkeypatch, tmp_path):
    target, drafter = trained_pair("llama", eagle31=True)
    target, drafter = copy.deepcopy(target), copy.deepcopy(drafter)
    drafter.set_target_embedding(target.get_input_embeddings())
    prompts = (PROMPTS[0:1], PROMPTS[3:4])
    expected = [target.generate(p, do_sample=False, max_new_tokens=16) for p in prompts]
    made = []
    monkeypatch.setattr(cpu_products, "_pack", lambda members, held, pack=cpu_products._pack: made.append(1) or pack(members, held))
    with hf_eagle31.hold_products(target), hf_eagle31.hold_products(drafter):
        count = len(made)
        outputs = [target.generate(p, assistant_model=drafter, do_sample=False, max_new_tokens=16) for p in prompts]
        assert count > 0 and len(made) == count  # the calls found the products held and used them
        target.save_pretrained(tmp_path)  # nothing in the model is packed: it saves as outside
        target.train()
        target(PROMPTS[:1], labels=PROMPTS[:1]).loss.backward()
        assert all(p.grad is not None for p in target.model.layers[0].parameters())
        target.zero_grad()
        target.eval()
        with torch.no_grad():
            target.model.layers[0].mlp.down_proj.weight.mul_(1.5)  # changed inside: held products are stale now
        changed = [target.generate(p, do_sample=False, max_new_tokens=16) for p in prompts]
        assert all(torch.equal(target.generate(p, assistant_model=drafter, do_sample=False, max_new_tokens=16), c)
                   for p, c in zip(prompts, changed))
    assert all(torch.equal(out, ref) for out, ref in zip(outputs, expected, strict=True))


def test_nested_blocks_hold_one_set_of_products_until_the_last_ends():
    target = make_target(seed=4)
    with hold_products(target):
        first = products_for(target)
        with hold_products(target):
            assert products_for(target) is first
        assert products_for(target) is first
    assert products_for(target) is not first  # a call's own now


def test_models_the_backend_cannot_serve_are_left_to_the_default_one():
    assert not can_pack(make_target(dtype=torch.float16))
    target = make_target(seed=5)
    target.model.layers[0].mlp._hf_hook = object()  # accelerate's: it moves weights in and out around forwards
    assert not can_pack(target)


def test_bf16_is_served_where_onednn_or_the_rows_kernel_multiply_it(monkeypatch):
    """On a CPU without AVX-512 oneDNN does not compute bf16, and bf16 models were left to torch's products (a third
    of the memory's rate): the rows library's AVX2 kernel multiplies them at its rate."""
    target = make_target(dtype=torch.bfloat16)
    monkeypatch.setattr(cpu_products, "fast_bf16", lambda device: False)
    monkeypatch.setattr(routes, "available", lambda dtype: ("torch",))
    assert not can_pack(target)
    monkeypatch.setattr(routes, "available", lambda dtype: ("rows", "torch"))
    assert can_pack(target)


def test_a_call_under_inference_mode_leaves_ordinary_weights_the_target_can_train_on():
    target, drafter = trained_pair("llama", eagle31=True)
    with torch.inference_mode():
        target.generate(PROMPTS[:1], assistant_model=drafter, do_sample=False, max_new_tokens=8)
    assert not any(p.is_inference() for p in [*target.parameters(), *drafter.parameters()])
    target(PROMPTS[:1]).logits.sum().backward()  # raised "Inference tensors cannot be saved for backward"


# --- what the products are made from, and when they may not stand in for the layers --------------------------------


def _edit(target, how: str) -> None:
    """A weight edit that keeps the version counter: the ways users and libraries change weights in place."""
    weight = target.model.layers[1].mlp.down_proj.weight
    if how == "fused AdamW":
        target.train()
        target(PROMPTS[:1], labels=PROMPTS[:1]).loss.backward()
        target.eval()
        torch.optim.AdamW(target.parameters(), lr=0.05, fused=True).step()
        target.zero_grad(set_to_none=True)
    with torch.no_grad():
        if how == "data.add_":
            weight.data.add_(torch.randn_like(weight) * 0.3)
        elif how == "data.copy_":
            weight.data.copy_(torch.randn_like(weight) * 0.3)
        elif how == "data =":
            weight.data = -weight.data
        elif how == "vector_to_parameters":
            vector = torch.nn.utils.parameters_to_vector(target.parameters())
            torch.nn.utils.vector_to_parameters(vector * 1.25, target.parameters())
        elif how == "one element":
            weight.data[3, 5] += 2.0


@pytest.mark.parametrize("how", ["data.add_", "data.copy_", "data =", "vector_to_parameters", "fused AdamW",
                                 "one element"])
def test_held_products_follow_a_weight_edited_behind_its_version_counter(how, monkeypatch):
    """(Before: the held oneDNN copies stayed as they were: plain [90, 208, 208, 132, ...], EAGLE and fast_decoding
    [192, 192, 192, 192, 76, 147, ...].) fp32 on oneDNN's copies, so that greedy output is exact."""
    monkeypatch.setattr(cpu_products, "rows_layout", lambda dtype: False)
    target, drafter = trained_pair("llama", eagle31=True)
    target, drafter = copy.deepcopy(target), copy.deepcopy(drafter)
    drafter.set_target_embedding(target.get_input_embeddings())
    prompt = PROMPTS[:1]
    with hold_products(target), hold_products(drafter):
        target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=4)
        _edit(target, how)
        plain = target.generate(prompt, do_sample=False, max_new_tokens=24)
        assert torch.equal(target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=24), plain)
        assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=24,
                                           custom_generate=hf_eagle31.fast_decoding), plain)


def test_a_model_converted_inside_hold_products_decodes_in_its_new_dtype():
    """(Before: a raw oneDNN primitive error, the bf16 products kept for fp32 weights.)"""
    target = make_target(seed=8, dtype=torch.bfloat16)
    if not can_pack(target):
        pytest.skip("bf16 runs on the CPU backend only where oneDNN computes it")
    with hold_products(target):
        target.to(torch.float32)
        plain = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=16)
        assert torch.equal(target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=16,
                                           custom_generate=hf_eagle31.fast_decoding), plain)


class RoundedWeight(torch.Tensor):
    """A fake-quantized weight: its `F.linear` multiplies by the weight rounded to eighths."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            weight = args[1].as_subclass(torch.Tensor)
            return func(args[0], torch.round(weight * 8) / 8, *args[2:], **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


class FavourToken(torch.overrides.TorchFunctionMode):
    """A user's mode that changes what `F.linear` gives on one weight (the head): token 7 always wins."""

    def __init__(self, head: torch.Tensor):
        super().__init__()
        self.head = head

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.linear and args[1] is self.head:
            out[..., 7] += 1000.0
        return out


@pytest.mark.parametrize("case", ["fake-quantized weights", "a user's torch function mode", "autocast",
                                  "a non-contiguous weight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_what_changes_how_torch_multiplies_is_honoured(case, dtype):
    """(Before: fake-quantized weights multiplied on their raw storage, a user's mode skipped for verify products
    (plain [7, 7, 7, ...], EAGLE a mix), raw errors `rows_linear: fp32 input expected` under autocast and for a
    non-contiguous weight.) Such calls run on the default backend, or such layers as modules."""
    target = make_target(seed=9, dtype=dtype)
    if not can_pack(target):
        pytest.skip("bf16 runs on the CPU backend only where oneDNN computes it")
    drafter = make_drafter(target)
    drafter.generation_config.verify_mode = "exact" if dtype == torch.bfloat16 else "batched"
    context = contextlib.nullcontext()
    if case == "fake-quantized weights":
        for layer in target.model.layers:
            layer.mlp.up_proj.weight = torch.nn.Parameter(RoundedWeight(layer.mlp.up_proj.weight.detach()))
    elif case == "a user's torch function mode":
        context = FavourToken(target.lm_head.weight)
    elif case == "autocast":
        context = torch.autocast("cpu", torch.bfloat16)
    else:
        layer = target.model.layers[0].self_attn.o_proj
        layer.weight = torch.nn.Parameter(layer.weight.detach().t().contiguous().t())
    prompt, new = PROMPTS[:1], 16 if dtype == torch.float32 else 6  # bf16: "exact" verification, slower
    with context:
        plain = target.generate(prompt, do_sample=False, max_new_tokens=new)
        eagle = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=new)
        fast = target.generate(prompt, do_sample=False, max_new_tokens=new, custom_generate=hf_eagle31.fast_decoding)
    assert torch.equal(eagle, plain) and torch.equal(fast, plain)
    if case == "a user's torch function mode":
        assert (plain[0, prompt.shape[1]:] == 7).all()
