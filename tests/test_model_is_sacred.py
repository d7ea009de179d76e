"""The user's model is never harmed: whatever happens during an EAGLE call (an interrupt at any point, a patched
layer, accelerate's offloading, another thread's plain call, training or saving inside `hold_products`), the target
and the drafter are afterwards what they were, and plain `generate` gives what it gave before."""

import _thread
import copy
import random
import threading
import time

import pytest
import torch
from accelerate import disk_offload
from tiny_models import PROMPTS, make_drafter, make_target, trained_pair
from transformers import LlamaConfig, LlamaForCausalLM

import hf_eagle31
from hf_eagle31 import generation
from hf_eagle31.backends import fast_bf16
from hf_eagle31.backends.cpu import products as cpu_products

NEW = 24


def state(model) -> dict:
    """What a call must leave as it was: every tensor bit for bit, the forwards set on instances, the hooks, the
    attention implementation."""
    return {
        "tensors": {name: t.detach().clone() for name, t in model.state_dict().items()},
        "forwards": {name: vars(m).get("forward") for name, m in model.named_modules()},
        "hooks": {name: [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]  # transformers' own included
                  for name, m in model.named_modules()},
        "attention": getattr(model.config, "_attn_implementation", None),
        "training": model.training,
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit; a weight accelerate keeps on disk is "meta" here: its place, shape and dtype."""
    if a.is_meta or b.is_meta:
        return a.is_meta and b.is_meta and a.shape == b.shape and a.dtype == b.dtype
    return torch.equal(a, b)


def assert_same(model, before: dict) -> None:
    after = state(model)
    assert after["tensors"].keys() == before["tensors"].keys()
    changed = [name for name, t in after["tensors"].items() if not same(t, before["tensors"][name])]
    assert changed == []
    assert after["forwards"] == before["forwards"] and after["hooks"] == before["hooks"]
    assert after["attention"] == before["attention"] and after["training"] == before["training"]


def eight_layer_target(dtype: torch.dtype):
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(11)
    return LlamaForCausalLM(config).to(dtype).eval()


@pytest.mark.parametrize("cpu_backend", [True, False])
def test_interrupts_at_random_points_of_eagle_calls_leave_both_models_as_they_were(cpu_backend):
    """Ctrl-C as `_thread.interrupt_main` from a timer, at random points of EAGLE calls on an 8-layer target (bf16
    where the CPU computes it). Each interrupted call leaves target and drafter bit for bit as they were, and plain
    `generate` gives its output of before. (Before: layers left holding NaN stand-ins, `generate` then decoding
    token 0 everywhere, a registry stuck so that `state_dict` refused for the rest of the process.)"""
    target = eight_layer_target(torch.bfloat16 if fast_bf16(torch.device("cpu")) else torch.float32)
    drafter = make_drafter(target)
    drafter.generation_config.update(cpu_backend=cpu_backend, speculation_mode="tree", collapse_fallback=False)
    prompt = PROMPTS[:1, :8]
    plain = target.generate(prompt, do_sample=False, max_new_tokens=NEW)
    target.generate(prompt, do_sample=False, max_new_tokens=NEW, assistant_model=drafter)  # warm-up
    started = time.perf_counter()
    eagle = target.generate(prompt, do_sample=False, max_new_tokens=NEW, assistant_model=drafter)  # bf16: may differ
    duration = time.perf_counter() - started  # from plain at near-ties; the same before and after, the models intact
    target_before, drafter_before = state(target), state(drafter)
    generator, interrupted = random.Random(0), 0
    for attempt in range(40):
        # anywhere in the call, and (every other try) in its last tenth, where the previous design unpacked weights
        when = generator.uniform(0, 1.1) if attempt % 2 else generator.uniform(0.88, 1.02)
        timer = threading.Timer(when * duration, _thread.interrupt_main)
        try:
            timer.start()
            target.generate(prompt, do_sample=False, max_new_tokens=NEW, assistant_model=drafter)
            timer.join()  # it may fire after the call: catch it here, not in the next one
            time.sleep(0.001)
        except KeyboardInterrupt:
            interrupted += 1
        finally:
            timer.cancel()
        assert_same(target, target_before)
        assert_same(drafter, drafter_before)
        assert generation._VERIFYING == {}
    assert interrupted >= 15
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=NEW), plain)
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=NEW, assistant_model=drafter), eagle)


@pytest.mark.parametrize("cpu_backend", [True, False])
def test_a_layer_patched_on_the_instance_is_honoured_and_kept(cpu_backend):
    """How accelerate's hooks, adapters and users patch layers: a forward set on the instance. EAGLE's output is
    plain `generate`'s with the patch, and the patch is still there after. (Before: ignored, then deleted.)"""
    target, drafter = trained_pair("llama", eagle31=True)
    target, drafter = copy.deepcopy(target), copy.deepcopy(drafter)
    drafter.set_target_embedding(target.get_input_embeddings())
    drafter.generation_config.cpu_backend = cpu_backend
    layer = target.model.layers[2].mlp.down_proj
    delta = torch.nn.Linear(layer.in_features, layer.out_features, bias=False)
    torch.nn.init.normal_(delta.weight, std=0.2)
    patch = layer.forward = lambda x, own=layer.forward: own(x) + delta(x)  # a LoRA-like adapter
    prompt = PROMPTS[:1]
    patched = target.generate(prompt, do_sample=False, max_new_tokens=NEW)
    del layer.forward
    assert not torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=NEW), patched)  # it shows
    layer.forward = patch
    before = state(target)
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=NEW, assistant_model=drafter), patched)
    assert layer.forward is patch
    assert_same(target, before)
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=NEW), patched)


def test_a_target_offloaded_to_disk_by_accelerate_decodes_and_keeps_its_hooks(tmp_path):
    """(Before: a raw "not on the expected device meta" error, accelerate's wrappers removed from 43 of 77 modules,
    plain `generate` returning zeros after; with the embedding offloaded, advice to move the drafter to "meta".)"""
    target = make_target(seed=2)
    drafter = make_drafter(target)
    expected = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=NEW)
    disk_offload(target, tmp_path, execution_device="cpu")
    assert target.model.embed_tokens.weight.device.type == "meta"
    before, wrapped = state(target), [name for name, m in target.named_modules() if hasattr(m, "_hf_hook")]
    assert torch.equal(target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=NEW, assistant_model=drafter),
                       expected)
    assert_same(target, before)
    assert [name for name, m in target.named_modules() if hasattr(m, "_hf_hook")] == wrapped and len(wrapped) > 40
    assert torch.equal(target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=NEW), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_calls_in_another_thread_beside_eagle_calls_get_their_own_output(dtype):
    """(Before: on a bf16 target, plain `generate` beside an EAGLE call silently returned [131, 0, 0, ...].)"""
    if dtype == torch.bfloat16 and not fast_bf16(torch.device("cpu")):
        pytest.skip("bf16 runs on the CPU backend only where oneDNN computes it")
    target = eight_layer_target(dtype)
    drafter = make_drafter(target)
    prompts = [PROMPTS[i : i + 1, :8] for i in range(3)]
    expected = [target.generate(p, do_sample=False, max_new_tokens=NEW) for p in prompts]
    stop, plain_outputs, errors = threading.Event(), [], []

    def plain_calls():
        try:
            while not stop.is_set():
                for p, e in zip(prompts, expected):
                    plain_outputs.append(torch.equal(target.generate(p, do_sample=False, max_new_tokens=NEW), e))
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    thread = threading.Thread(target=plain_calls)
    thread.start()
    try:
        for _ in range(3):
            for p in prompts:
                target.generate(p, do_sample=False, max_new_tokens=NEW, assistant_model=drafter)
    finally:
        stop.set()
        thread.join()
    assert errors == [] and len(plain_outputs) >= 3 and all(plain_outputs)


@pytest.mark.parametrize("rows_kernel", [False, True])
def test_inside_hold_products_the_model_converts_copies_loads_and_keeps_new_parameters(rows_kernel, monkeypatch):
    """(Before, on oneDNN's layout: `.to(dtype)` accepted, leaving mixed dtypes; new Parameters reverted on exit;
    `deepcopy` and `load_state_dict` raw torch errors; a training step without gradients.)"""
    if not rows_kernel:  # fp32 otherwise takes the rows kernel where it builds, which copies nothing
        monkeypatch.setattr(cpu_products, "rows_layout", lambda dtype: False)
    target, drafter = trained_pair("llama", eagle31=True)
    target, drafter = copy.deepcopy(target), copy.deepcopy(drafter)
    drafter.set_target_embedding(target.get_input_embeddings())
    saved = copy.deepcopy(target.state_dict())
    new = torch.nn.Parameter(torch.randn_like(target.model.layers[0].mlp.up_proj.weight))
    with hf_eagle31.hold_products(target), hf_eagle31.hold_products(drafter):
        target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=8, assistant_model=drafter)
        copied = copy.deepcopy(target)
        target.load_state_dict(copied.state_dict())
        target.model.layers[0].mlp.up_proj.weight = new
        with_new = target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=NEW)
        assert torch.equal(target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=NEW, assistant_model=drafter),
                           with_new)
        target.to(torch.float64)
        assert {p.dtype for p in target.parameters()} == {torch.float64}
        target.to(torch.float32)
    assert target.model.layers[0].mlp.up_proj.weight is new
    target.load_state_dict(saved)
    target.train()
    target(PROMPTS[:1], labels=PROMPTS[:1]).loss.backward()
    assert all(p.grad is not None for p in target.parameters() if p.requires_grad)


def test_a_fresh_target_keeps_no_hooks_after_eagle_and_fast_decoding_calls():
    """(Before: one EAGLE call left transformers' output-capturing hooks on 12 modules of a fresh target: the prefill
    asks for hidden states, and transformers installs them for good at the first such forward.)"""
    target = make_target(seed=14)
    drafter = make_drafter(target)
    before = state(target)
    target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=8, assistant_model=drafter)
    target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=8, custom_generate=hf_eagle31.fast_decoding)
    assert_same(target, before)
    assert not any(m._forward_hooks for m in target.modules())
    target(PROMPTS[:1], output_hidden_states=True)  # a user's own forward still gets its hooks, and keeps them
    assert any(m._forward_hooks for m in target.modules())
    target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=8, assistant_model=drafter)
    assert any(m._forward_hooks for m in target.modules())
