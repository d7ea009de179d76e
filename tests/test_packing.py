"""Packed weights (hf_eagle31/packing.py): the target holds oneDNN's packed copy only while EAGLE decodes,
computes what torch's default path computes, and gets its own weights back bit for bit."""

import contextlib
import copy
import threading
import time

import pytest
import torch
from tiny_models import PROMPTS, make_target, trained_pair
from transformers import LlamaConfig, LlamaForCausalLM

import hf_eagle31  # noqa: F401  (routes generate(assistant_model=<EAGLE drafter>))
from hf_eagle31 import packing
from hf_eagle31.packing import (
    BATCH_HINT,
    _memory_of,
    _row_layout,
    can_pack,
    pack_linears,
    packed_weights,
    unpack_linears,
)

from hf_eagle31.training.capacity import add_decoder_layers

original = packing.PackedGroup.whole

pytestmark = pytest.mark.skipif(not can_pack(make_target()), reason="oneDNN packed linears need a CPU build with mkldnn")


@pytest.fixture(autouse=True)
def onednn_layout(monkeypatch):
    """These tests are about oneDNN's packed layout; fp32 weights on an AVX-512 CPU otherwise stay as they are for
    the rows kernel (tests/test_rows_linear.py)."""
    monkeypatch.setattr(packing, "rows_layout", lambda dtype: False)


def snapshot(model):
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def test_packed_forward_matches_the_default_path_and_unpacking_restores_every_bit():
    target = make_target(seed=3)
    before = snapshot(target)
    reference = target(PROMPTS[:2]).logits
    swapped = pack_linears(target)
    assert not target.config.tie_word_embeddings
    assert len(swapped) == 7 * target.config.num_hidden_layers + 1  # q, k, v, o, gate, up, down per layer; the head
    packed = target(PROMPTS[:2]).logits
    assert torch.allclose(packed, reference, atol=1e-4, rtol=1e-4)
    unpack_linears(swapped)
    after = snapshot(target)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert torch.equal(target(PROMPTS[:2]).logits, reference)


def test_a_call_on_its_way_when_another_thread_unpacks_runs_on_the_restored_weights():
    """An "exact" call holds no packing: the last packed call in another thread may unpack the target between
    the exact call's dispatch to a packed forward and its read of the packed weight (seen in CI as an AttributeError)."""
    target = tied_model()
    linear, embedding = target.model.layers[0].mlp.up_proj, target.get_input_embeddings()
    x, ids = torch.randn(2, linear.in_features), PROMPTS[:2]
    with packed_weights(target):
        linear_forward, embedding_forward = linear.forward, embedding.forward  # the packed ones, already bound
    assert torch.equal(linear_forward(x), torch.nn.functional.linear(x, linear.weight))
    assert torch.equal(embedding_forward(ids), embedding.weight[ids])


def test_forwards_in_another_thread_while_the_model_is_unpacked_under_them_are_unchanged():
    """A web service's threads: plain calls on the packed weights of an EAGLE call that unpacks under them. Each
    weight comes back before its forward goes (seen in CI as NaN logits, token 0) and an eager product needs no
    registry entry (a KeyError). The test packs only between forwards: packing under a running forward is not
    promised (`packed_weights`' docstring)."""
    target, ids = tied_model(), PROMPTS[:1]
    reference, stop, lock, forwards, problems = target(ids).logits, threading.Event(), threading.Lock(), [], []

    def pack_and_unpack():
        while not stop.is_set():
            with contextlib.ExitStack() as packing:
                with lock:
                    packing.enter_context(packed_weights(target))
                time.sleep(0.002)  # the other thread starts a forward on the packed weights

    packer = threading.Thread(target=pack_and_unpack)
    packer.start()
    try:
        start = time.perf_counter()
        while time.perf_counter() - start < 2:
            with lock:
                try:
                    forwards.append(torch.allclose(target(ids).logits, reference, atol=1e-4, rtol=1e-4))
                except Exception as error:  # noqa: BLE001  (a group unpacked under the call)
                    problems.append(repr(error))
            time.sleep(0.001)  # the packer's turn
    finally:
        stop.set()
        packer.join()
    assert problems == [] and all(forwards) and len(forwards) > 20


def test_siblings_are_one_product_and_each_takes_its_own_output():
    """q/k/v and gate/up are packed stacked: the first called computes all, the others take theirs; called with
    another input, or the same one changed in place since, a sibling computes again."""
    target = make_target(seed=5)
    attention = target.model.layers[0].self_attn
    x = torch.randn(1, 3, target.config.hidden_size)
    expected = {name: getattr(attention, name)(x) for name in ("q_proj", "k_proj", "v_proj")}
    with packed_weights(target):
        group = attention.q_proj.packed
        assert attention.k_proj.packed is group and attention.v_proj.packed is group
        assert target.model.layers[0].mlp.gate_proj.packed is target.model.layers[0].mlp.up_proj.packed
        assert group.sizes == [m.out_features for m in (attention.q_proj, attention.k_proj, attention.v_proj)]
        for order in (("q_proj", "k_proj", "v_proj"), ("v_proj", "q_proj", "k_proj")):
            for name in order:
                assert torch.allclose(getattr(attention, name)(x), expected[name], atol=1e-5, rtol=1e-4)
            assert group.pending is None  # all taken: nothing held
        attention.q_proj(x)
        x.mul_(2)  # the same tensor, other values: k must not come from the product before
        assert torch.allclose(attention.k_proj(x), 2 * expected["k_proj"], atol=1e-5, rtol=1e-4)
        assert torch.allclose(attention.k_proj(x / 2), expected["k_proj"], atol=1e-5, rtol=1e-4)


def tied_model(embedding_class=None, dtype=torch.float32):
    config = LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    if embedding_class is not None:
        model.model.embed_tokens = embedding_class(config.vocab_size, config.hidden_size)
        model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.to(dtype)


class ScaledEmbedding(torch.nn.Embedding):  # Gemma's: scales what nn.Embedding's forward looks up
    def forward(self, ids):
        return super().forward(ids) * 4.0


class IndexingEmbedding(torch.nn.Embedding):  # reads its weight without F.embedding
    def forward(self, ids):
        return self.weight[ids]


@pytest.mark.parametrize("shape", [(1000, 32), (1001, 40), (49152, 72), (20001, 40)])  # probed whole; repeated
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_of_a_packed_weight_is_found_where_the_layout_says(shape, dtype):
    weight = torch.randn(shape).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
    starts, offsets = _row_layout(shape, dtype)
    assert torch.equal(_memory_of(packed)[starts.unsqueeze(-1) + offsets], weight)


@pytest.mark.parametrize("embedding_class", [None, ScaledEmbedding])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [1, 3, 9])
def test_a_tied_head_is_packed_and_its_embedding_reads_rows_from_it(embedding_class, dtype, length):
    model = tied_model(embedding_class, dtype)
    ids = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 23, 999][-length:]])
    reference, looked_up = model(ids).logits, model.model.embed_tokens(ids)
    swapped = pack_linears(model)
    assert hasattr(model.lm_head, "packed") and torch.isnan(model.model.embed_tokens.weight).all()  # no second copy
    assert torch.equal(model.model.embed_tokens(ids), looked_up)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(model(ids).logits, reference, atol=tolerance, rtol=tolerance)
    unpack_linears(swapped)
    assert not any("forward" in vars(m) or hasattr(m, "packed_rows") for m in model.modules())
    assert torch.equal(model(ids).logits, reference)


def test_a_tied_head_whose_embedding_bypasses_f_embedding_is_multiplied_transposed():
    model = tied_model(IndexingEmbedding)
    ids = torch.tensor([[3, 5, 7, 11, 13]])
    reference = model(ids).logits
    swapped = pack_linears(model)
    assert not hasattr(model.lm_head, "packed") and torch.isfinite(model.model.embed_tokens.weight).all()
    assert torch.allclose(model(ids).logits, reference, atol=1e-5, rtol=1e-4)
    unpack_linears(swapped)
    assert "forward" not in vars(model.lm_head) and torch.equal(model(ids).logits, reference)


@pytest.mark.parametrize("length", [1, 3, 5, 9])  # MKL's transposed product for 2-4 rows, oneDNN's otherwise
def test_a_weight_tied_to_more_than_an_embedding_stays_as_it_is_and_computes_the_same(length):
    model = tied_model()
    model.extra_head = torch.nn.Linear(32, 1000, bias=False)
    model.extra_head.weight = model.lm_head.weight  # a third user: the packed memory could not serve it
    ids = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 23, 29][:length]])
    reference = model(ids).logits
    swapped = pack_linears(model)
    assert not hasattr(model.lm_head, "packed") and torch.isfinite(model.model.embed_tokens.weight).all()
    assert torch.allclose(model(ids).logits, reference, atol=1e-5, rtol=1e-4)  # the head multiplied transposed
    unpack_linears(swapped)
    assert "forward" not in vars(model.lm_head) and torch.equal(model(ids).logits, reference)


@pytest.mark.parametrize("layers", [1, 2])
def test_a_packed_drafter_computes_its_default_path_with_one_product_per_sibling_group(layers, monkeypatch):
    """The drafter takes q/k/v and gate/up as one product each (`sibling_products`), and a hook on a projection
    sends that group back to the module calls, which the hook then sees."""
    target, drafter = trained_pair("llama", eagle31=True)
    drafter = copy.deepcopy(drafter)  # the fitted pair is shared by the tests: grow a copy
    add_decoder_layers(drafter, layers)
    ids, features = PROMPTS[:2, :6], torch.randn(2, 6, 3 * target.config.hidden_size)
    with torch.no_grad():
        reference = drafter(ids, features)
        products = []
        monkeypatch.setattr(packing.PackedGroup, "whole", lambda group, x: products.append(x) or original(group, x))
        with packed_weights(drafter):
            packed = drafter(ids, features)
            assert len(products) == 2 + 4 * layers  # fc, the head; q/k/v, o, gate/up, down in each layer
            seen = []
            hook = drafter.midlayer.self_attn.k_proj.register_forward_hook(lambda m, args, out: seen.append(out.shape))
            hooked = drafter(ids, features)
            hook.remove()
    torch.testing.assert_close(packed.logits, reference.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(packed.hidden_states, reference.hidden_states, atol=1e-4, rtol=1e-4)
    assert seen == [torch.Size([2, 6, drafter.midlayer.self_attn.k_proj.out_features])]
    torch.testing.assert_close(hooked.logits, reference.logits, atol=1e-4, rtol=1e-4)


def test_an_eagle_call_leaves_the_target_as_it_found_it():
    target, drafter = trained_pair("llama", eagle31=True)
    before = snapshot(target)
    with packed_weights(target):
        assert any(hasattr(m, "packed") for m in target.modules())
    after = snapshot(target)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert not any(hasattr(m, "packed") for m in target.modules())
    drafted_before = snapshot(drafter)
    target.generate(PROMPTS[:1], assistant_model=drafter, do_sample=False, max_new_tokens=12)
    assert all(torch.equal(before[name], t) for name, t in snapshot(target).items())
    assert all(torch.equal(drafted_before[name], t) for name, t in snapshot(drafter).items())
    assert not any(hasattr(m, "packed") for m in drafter.modules())


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_on_packed_weights_equals_plain_generate(mode):
    target, drafter = trained_pair("llama", eagle31=True)
    drafter.generation_config.update(speculation_mode=mode, pack_weights=True)
    for prompt in (PROMPTS[0:1], PROMPTS[3:4]):
        expected = target.generate(prompt, do_sample=False, max_new_tokens=24)
        assert torch.equal(target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=24), expected)


def test_nested_calls_pack_once_and_unpack_with_the_last():
    target = make_target(seed=4)
    with packed_weights(target):
        first = [m.packed.weight for m in target.modules() if hasattr(m, "packed")]
        with packed_weights(target):
            assert [m.packed.weight for m in target.modules() if hasattr(m, "packed")] == first
        assert all(hasattr(m, "packed") for m in target.modules() if isinstance(m, torch.nn.Linear))
    assert not any(hasattr(m, "packed") for m in target.modules())


def test_a_serving_loop_packs_once_for_all_its_calls_and_refuses_a_save_inside(monkeypatch, tmp_path):
    target, drafter = trained_pair("llama", eagle31=True)
    prompts = (PROMPTS[0:1], PROMPTS[3:4])
    expected = [target.generate(p, do_sample=False, max_new_tokens=16) for p in prompts]  # torch's default path
    reorders, reorder = [], torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight",
                        lambda weight, hint: reorders.append(weight) or reorder(weight, hint), raising=False)
    with hf_eagle31.packed_weights(target), hf_eagle31.packed_weights(drafter):
        packed = len(reorders)
        outputs = [target.generate(p, assistant_model=drafter, do_sample=False, max_new_tokens=16) for p in prompts]
        assert packed > 0 and len(reorders) == packed  # the calls found the weights packed and kept them so
        with pytest.raises(RuntimeError, match="packed for oneDNN"):
            target.save_pretrained(tmp_path)
    assert all(torch.equal(out, ref) for out, ref in zip(outputs, expected, strict=True))
    assert all(torch.isfinite(t).all() for t in target.state_dict().values())  # unpacked: saving works again


def test_models_that_cannot_be_packed_are_left_alone():
    assert not can_pack(make_target(dtype=torch.float16))
    target = make_target(seed=5, dtype=torch.float16)
    with packed_weights(target):
        assert not any(hasattr(m, "packed") for m in target.modules())


def test_a_call_under_inference_mode_leaves_ordinary_weights_the_target_can_train_on():
    target, drafter = trained_pair("llama", eagle31=True)
    with torch.inference_mode():
        target.generate(PROMPTS[:1], assistant_model=drafter, do_sample=False, max_new_tokens=8)
    assert not any(p.is_inference() for p in [*target.parameters(), *drafter.parameters()])
    target(PROMPTS[:1]).logits.sum().backward()  # raised "Inference tensors cannot be saved for backward"


def test_a_failure_while_packing_gives_every_weight_back(monkeypatch):
    target = make_target(seed=6)
    before = snapshot(target)
    calls, reorder = [], torch.ops.mkldnn._reorder_linear_weight

    def failing(weight, hint):  # the sixth weight fails, after five were packed
        if len(calls) == 5:
            raise RuntimeError("oneDNN failed")
        calls.append(weight)
        return reorder(weight, hint)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", failing, raising=False)
    with pytest.raises(RuntimeError, match="oneDNN failed"):
        pack_linears(target)
    assert len(calls) == 5
    assert all(torch.equal(before[name], t) for name, t in snapshot(target).items())
    assert not any("forward" in vars(m) or hasattr(m, "packed") for m in target.modules())
