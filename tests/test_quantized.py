"""bitsandbytes-quantized targets: EAGLE decoding equals the same quantized target's plain greedy output.

They compute in bf16, where batched kernels round differently from one-row ones often enough to flip
near-tied argmaxes, so these tests verify with `verify_mode="exact"`, which must be bit-identical.

bitsandbytes runs on CPU, so these run in the normal suite; without it they skip with the reason.
The same tests run on a CUDA GPU when there is one (`pytest -m cuda`).
"""

import pytest
import torch
from tiny_models import PROMPTS, drafter_config, trained_pair

import hf_eagle31

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")

from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]
QUANTIZATIONS = {
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "nf4-double-quant": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "int8": dict(load_in_8bit=True),
}


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    target, drafter = trained_pair("llama", True)
    folder = tmp_path_factory.mktemp("target")
    target.save_pretrained(folder)
    return folder, drafter


def quantized(folder, name, device="cpu"):
    config = BitsAndBytesConfig(**QUANTIZATIONS[name], bnb_4bit_compute_dtype=torch.bfloat16)
    return AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=config, dtype=torch.bfloat16, device_map=device
    ).eval()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(QUANTIZATIONS))
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_quantized_target_greedy_equals_its_plain_generate(saved_pair, name, mode, device):
    folder, fitted = saved_pair
    target = quantized(folder, name, device)
    drafter = hf_eagle31.Eagle3DraftModel(drafter_config(target)).to(device, torch.bfloat16).eval()
    drafter.load_state_dict(fitted.state_dict())  # the drafter fitted to the unquantized target, in bf16
    drafter.generation_config.update(speculation_mode=mode, collapse_fallback=False, verify_mode="exact")
    for prompt in (PROMPTS[0:1].to(device), PROMPTS[3:4].to(device)):
        expected = target.generate(prompt, do_sample=False, max_new_tokens=24)
        out = target.generate(prompt, do_sample=False, max_new_tokens=24, assistant_model=drafter)
        assert torch.equal(out, expected), (name, mode, prompt.tolist())
    assert drafter.get_input_embeddings() is target.get_input_embeddings()  # shared, not a second copy


def test_drafter_overhead_is_reported_next_to_a_quantized_target(saved_pair):
    from hf_eagle31.planner import drafter_memory_report

    folder, fitted = saved_pair
    target = quantized(folder, "nf4")
    drafter = hf_eagle31.Eagle3DraftModel(drafter_config(target)).to(torch.bfloat16)
    drafter.set_target_embedding(target.get_input_embeddings())
    report = drafter_memory_report(drafter, target)
    expected = sum(t.numel() * t.element_size() for t in [*drafter.parameters(), *drafter.buffers()])
    assert report["drafter_bytes"] == expected and report["embedding_shared"]
    assert report["percent"] == pytest.approx(100 * expected / report["target_bytes"])
