"""A product's case and its check, for the tests of the rows kernel (test_rows_kernel.py) and of the AVX2 products
(test_avx2_kernel.py): both compute torch's product of a few rows, each output summed in fp32 and rounded once to the
input's dtype."""

import torch
import torch.nn.functional as F


def product_case(rows: int, features: tuple[int, int], dtype: torch.dtype
                 ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """x [2, rows, K] (leading dimensions kept), two weights [N, K] and [5, K] and their bias, for `features` (K, N)."""
    in_features, out_features = features
    torch.manual_seed(rows)
    x = torch.randn(2, rows, in_features).to(dtype)
    weights = [torch.randn(out_features, in_features).to(dtype), torch.randn(5, in_features).to(dtype)]
    return x, weights, torch.randn(out_features + 5).to(dtype)


def assert_product(out: torch.Tensor, x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None) -> None:
    """`out` is `x` times `weights` side by side plus `bias`: close to the exact sums (in fp32), in `x`'s dtype."""
    weight = torch.cat(weights)
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert out.dtype == x.dtype and out.shape == expected.shape
    # fp32: sums in another order; bf16: each output rounded once to bf16 (8 bits), as torch's bf16 product does
    tolerance = dict(atol=2e-4 * x.shape[-1] ** 0.5, rtol=1e-4) if x.dtype == torch.float32 else \
        dict(atol=1e-3 * x.shape[-1] ** 0.5, rtol=2 ** -8)
    torch.testing.assert_close(out.float(), expected, **tolerance)
    if x.dtype == torch.bfloat16:  # and as close to the exact sums as torch's own bf16 product
        ours = (out.float() - expected).abs().max()
        torchs = (F.linear(x, weight, bias).float() - expected).abs().max()
        assert ours <= 2 * torchs + 1e-6
