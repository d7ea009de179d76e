"""The drafter's forward computed whole by the rows library (hf_eagle31/backends/cpu/draft.py) against the drafter's
own module forward on the same products, and EAGLE decoding on it against plain `generate`."""

import pytest
import torch
from tiny_models import PROMPTS, make_drafter, make_target, trained_pair

from hf_eagle31.backends import fast_bf16
from hf_eagle31.backends.cpu import CPU, draft, rows
from hf_eagle31.backends.cpu.products import can_pack
from hf_eagle31.drafting import DrafterState, draft_tree

pytestmark = pytest.mark.skipif(not (can_pack(make_target()) and rows.rows_kernel()),
                                reason="the rows library needs a CPU with AVX-512 and a C++ compiler")

VARIANTS = {  # drafter layouts the module forward defines: EAGLE 3.1, EAGLE-3, and the variants vLLM serves
    "eagle3.1": dict(eagle31=True),
    "eagle3": dict(eagle31=False),
    "norm before fc": dict(eagle31=False, norm_before_fc=True),
    "norm before residual": dict(eagle31=True, norm_before_residual=True),
    "biases": dict(eagle31=True, attention_bias=True, mlp_bias=True),
}


def drafted(drafter, forward) -> list[torch.Tensor]:
    """What a state drafting on `forward` (None: the modules') computes from the same features: a two-row catch-up on
    the prompts, a tree in each row, a static one (every cache slot attended), an uneven catch-up (logits picked by
    index), and the cache buffers after."""
    torch.manual_seed(0)
    width = drafter.fc.in_features
    features = torch.randn(2, 12, width).to(drafter.dtype)
    tokens = torch.randint(3, drafter.config.vocab_size, (2, 12))
    state = DrafterState(drafter, 2, CPU.products(drafter), 64, None, forward)
    for row in range(2):
        state.push(features[row : row + 1, :8], tokens[row : row + 1, :8], row)
    first = state.catch_up()
    for row in range(2):
        state.push(features[row : row + 1, 8:9], tokens[row : row + 1, 8:9], row)
    trees = draft_tree(state, tokens[:, 8], depth=3, top_k=3, total_tokens=6)
    for row in range(2):
        state.push(features[row : row + 1, 9:10], tokens[row : row + 1, 9:10], row)
    trees += draft_tree(state, tokens[:, 9], depth=3, top_k=3, total_tokens=6, static=True)
    state.push(features[:1, 9:12], tokens[:1, 9:12], 0)
    state.push(features[1:, 9:10], tokens[1:, 9:10], 1)
    last = state.catch_up()
    keys, values = state.cache.layers[0]
    return [*first, *last, keys, values, *(tree.tokens for tree in trees), *(tree.parents for tree in trees)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_whole_forward_computes_the_module_forward_fp32(variant):
    drafter = make_drafter(make_target(), **VARIANTS[variant])
    with torch.no_grad():
        for bias in (module.bias for module in drafter.modules() if isinstance(module, torch.nn.Linear)):
            if bias is not None:
                bias.normal_()
    forward = CPU.draft_forward(drafter, CPU.products(drafter))
    assert forward is not None
    modules, whole = drafted(drafter, None), drafted(drafter, forward)
    for expected, got in zip(modules, whole):
        assert expected.shape == got.shape
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # the trees' tokens and parents exactly


@pytest.mark.skipif(not fast_bf16(torch.device("cpu")), reason="bf16 products need a CPU that computes bf16")
def test_whole_forward_rounds_as_the_module_forward_bf16():
    drafter = make_drafter(make_target(dtype=torch.bfloat16))
    forward = CPU.draft_forward(drafter, CPU.products(drafter))
    assert forward is not None
    modules, whole = drafted(drafter, None), drafted(drafter, forward)
    for expected, got in zip(modules[:4], whole[:4]):  # the first catch-up: states and logits a rounding or two apart
        scale = float(expected.float().abs().max())
        torch.testing.assert_close(got.float(), expected.float(), rtol=0.0, atol=4 * 2**-8 * scale)


def test_drafters_the_library_does_not_compute_run_their_modules():
    target = make_target()
    assert CPU.draft_forward(make_drafter(target, num_hidden_layers=2), None) is None  # no products
    stacked = make_drafter(target, num_hidden_layers=2)
    assert CPU.draft_forward(stacked, CPU.products(stacked)) is None  # a layer stacked after the first
    hooked = make_drafter(target)
    handle = hooked.midlayer.register_forward_hook(lambda *_: None)
    assert CPU.draft_forward(hooked, CPU.products(hooked)) is None
    handle.remove()
    assert CPU.draft_forward(hooked, CPU.products(hooked)) is not None
    training = make_drafter(target).train()
    assert CPU.draft_forward(training, CPU.products(training)) is None


def test_greedy_eagle_on_the_whole_forward_equals_plain_generate(monkeypatch):
    target, drafter = trained_pair()
    calls = []
    original = draft._forward
    monkeypatch.setattr(draft, "_forward", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    drafter.generation_config.cpu_backend = True
    for prompt in PROMPTS[:3]:
        prompt = prompt[None]
        plain = target.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
        eagle = target.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0, assistant_model=drafter)
        assert torch.equal(eagle, plain)
    assert calls  # drafted on the library
