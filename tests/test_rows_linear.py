"""The fp32 rows kernel (kernels/rows_linear.cpp) against torch's products, and packing's layout that uses it:
the weights stay as they are, forwards compute what torch's default path computes, greedy EAGLE equals plain."""

import pytest
import torch
import torch.nn.functional as F
from tiny_models import PROMPTS, make_target, trained_pair

import hf_eagle31  # noqa: F401  (routes generate(assistant_model=<EAGLE drafter>))
from hf_eagle31 import packing
from hf_eagle31.kernels.rows_linear import rows_kernel, rows_linear
from hf_eagle31.packing import pack_linears, packed_weights, unpack_linears

pytestmark = pytest.mark.skipif(not rows_kernel(), reason="the rows kernel needs a CPU with AVX-512 and a C++ compiler")


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 13, 16, 17, 40])  # 1 and 40: torch's; 17: a second pass of 16
@pytest.mark.parametrize("features", [(576, 1536), (1536, 577), (100, 7), (24, 3)])  # tails of 16 inputs, 6 outputs
def test_the_kernel_computes_torchs_product(rows, features):
    in_features, out_features = features
    torch.manual_seed(rows)
    x = torch.randn(2, rows, in_features)[:, :, :]  # leading dimensions kept
    weights = [torch.randn(out_features, in_features), torch.randn(5, in_features)]
    bias = torch.randn(out_features + 5)
    expected = F.linear(x, torch.cat(weights), bias)
    out = rows_linear(x[:1], weights, bias)
    assert out.shape == expected[:1].shape
    torch.testing.assert_close(out, expected[:1], atol=2e-4 * in_features ** 0.5, rtol=1e-4)
    torch.testing.assert_close(rows_linear(x[:1], weights[:1], None), F.linear(x[:1], weights[0]),
                               atol=2e-4 * in_features ** 0.5, rtol=1e-4)


def test_the_kernel_refuses_what_it_cannot_multiply():
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="fp32 input"):
        torch.ops.hf_eagle31_rows.linear(x.double(), [torch.randn(4, 8)], None)
    with pytest.raises(RuntimeError, match="8 input features"):
        torch.ops.hf_eagle31_rows.linear(x, [torch.randn(4, 9)], None)


def test_fp32_packing_leaves_the_weights_where_they_are_and_computes_the_same(monkeypatch):
    target = make_target(seed=3)
    target.tie_weights()
    pointers = {name: p.data_ptr() for name, p in target.named_parameters()}
    before = {name: p.detach().clone() for name, p in target.state_dict().items()}
    reference = target(PROMPTS[:2, :9]).logits
    calls = []
    kernel = torch.ops.hf_eagle31_rows.linear
    monkeypatch.setattr(packing, "rows_linear", lambda x, weights, bias: calls.append(len(weights)) or
                        kernel(x, list(weights), bias))
    with packed_weights(target):
        assert all(m.packed.members and m.packed.weight is None for m in target.modules() if hasattr(m, "packed"))
        logits = target(PROMPTS[:2, :9]).logits
        saved = target.state_dict()  # the weights are there: nothing refuses
    assert calls and max(calls) == 3  # q/k/v in one call
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
    assert {name: p.data_ptr() for name, p in target.named_parameters()} == pointers
    assert all(torch.equal(before[name], saved[name]) for name in before)
    assert not any(hasattr(m, "packed") or "forward" in vars(m) for m in target.modules())
    assert torch.equal(target(PROMPTS[:2, :9]).logits, reference)


def test_a_failure_while_packing_leaves_every_forward_as_it_was(monkeypatch):
    target = make_target(seed=4)
    monkeypatch.setattr(packing, "PackedGroup", lambda *args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        pack_linears(target)
    assert not any(hasattr(m, "packed") or "forward" in vars(m) for m in target.modules())
    unpack_linears([])


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_on_the_rows_kernel_equals_plain_generate(mode, monkeypatch):
    target, drafter = trained_pair("llama", eagle31=True)
    drafter.generation_config.update(speculation_mode=mode, pack_weights=True)
    rows, kernel = [], torch.ops.hf_eagle31_rows.linear
    monkeypatch.setattr(packing, "rows_linear", lambda x, weights, bias: rows.append(x.numel() // x.shape[-1]) or
                        kernel(x, list(weights), bias))
    for prompt in (PROMPTS[0:1], PROMPTS[3:4]):
        expected = target.generate(prompt, do_sample=False, max_new_tokens=24)
        assert torch.equal(target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=24), expected)
    assert any(n > 1 for n in rows)  # blocks of drafts went through it


def test_a_kernel_that_cannot_build_falls_back_to_onednn_with_a_warning(monkeypatch):
    from torch.utils import cpp_extension

    def no_ninja(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", no_ninja)
    with pytest.warns(UserWarning, match="rows kernel did not build .*Ninja is required.*packing for oneDNN instead"):
        assert rows_kernel.__wrapped__() is False
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert rows_kernel.__wrapped__() is False  # no AVX-512: not even tried
