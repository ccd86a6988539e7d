"""Weight-only quantization: the grids, and torch's kernels against the dense weights they stand for."""

from __future__ import annotations

import pytest
import torch

from specgate.engine.models.linear import MAX_KERNEL_ROWS, Int4Linear, Int8Linear, kernel_rows, make_linear
from specgate.engine.models.quant import (
    dequantize_int4,
    dequantize_int8,
    int4_supported,
    quantize_int4,
    quantize_int8,
)

# Bounds on |kernel - x @ dequantized.T| relative to the output's scale. fp32: the kernels compute the
# same products in another order. bf16: activations, scales and minimums are rounded to bf16
# (8 significant bits) before the product.
KERNEL_BOUND = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def q4_1_like(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """A weight as GGUF's Q4_1 dequantizes: per group of 32, q * d + m with q in 0..15 (both ends used)."""
    g = torch.Generator().manual_seed(seed)
    groups = in_features // 32
    q = torch.randint(0, 16, (out_features, groups, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(out_features, groups, 1, generator=g) * 0.01 + 1e-3
    m = torch.randn(out_features, groups, 1, generator=g) * 0.05
    return (q * d + m).view(out_features, in_features)


def test_int4_reproduces_a_q4_1_weight() -> None:
    w = q4_1_like(48, 96)
    assert torch.allclose(dequantize_int4(quantize_int4(w)), w, atol=1e-6, rtol=0)


def test_int4_error_is_at_most_half_a_step() -> None:
    w = torch.randn(40, 64)
    qw = quantize_int4(w)
    err = (dequantize_int4(qw) - w).abs().view(40, 2, 32)
    assert (err <= qw.scale[..., None] / 2 + 1e-6).all()
    assert qw.q.min() >= 0 and qw.q.max() <= 15


def test_constant_groups_are_exact() -> None:
    w = torch.full((8, 64), 0.25)
    w[1] = 0.0
    assert torch.equal(dequantize_int4(quantize_int4(w)), w)
    assert torch.allclose(dequantize_int8(quantize_int8(w)), w)


def test_int8_error_is_at_most_half_a_step_per_row() -> None:
    w = torch.randn(40, 64)
    qw = quantize_int8(w)
    assert ((dequantize_int8(qw) - w).abs() <= qw.scale[:, None] / 2 + 1e-6).all()
    assert qw.q.dtype == torch.int8 and qw.q.abs().max() == 127


def test_int4_needs_whole_groups() -> None:
    assert not int4_supported((16, 48))
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_int4(torch.randn(16, 48))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kind", "reference"), [(Int8Linear, "int8"), (Int4Linear, "int4")])
@pytest.mark.parametrize("shape", [(96, 64), (384, 128), (1536, 576)])
def test_kernel_matches_the_dequantized_weight(
    kind: type, reference: str, shape: tuple[int, int], dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    w, bias = torch.randn(shape) * 0.05, torch.randn(shape[0])
    x = torch.randn(5, shape[1]).to(dtype)
    layer = kind(w, bias, dtype, False)
    dense = dequantize_int8(quantize_int8(w)) if reference == "int8" else dequantize_int4(quantize_int4(w))
    expected = x.float() @ dense.T + bias
    got = layer(x)
    assert got.dtype == dtype and got.shape == (5, shape[0])
    err = (got.float() - expected).abs().max() / expected.abs().max()
    assert err < KERNEL_BOUND[dtype]
    # Leading dimensions are kept, one row gives what the same row gives in a batch.
    assert torch.allclose(layer(x.unsqueeze(0))[0].float(), got.float())
    # Many rows (prefill) take the dense form of the same quantized weight.
    many = torch.randn(3 * MAX_KERNEL_ROWS, shape[1]).to(dtype)
    expected = many.float() @ dense.T + bias
    err = (layer(many).float() - expected).abs().max() / expected.abs().max()
    assert err < KERNEL_BOUND[dtype]


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_make_linear_keeps_the_layer_close_to_dense(mode: str) -> None:
    torch.manual_seed(1)
    w = q4_1_like(64, 128)
    x = torch.randn(3, 128)
    layer = make_linear(w, None, mode, torch.float32, pack=False)
    # int4 reproduces a Q4_1 weight; int8's per-row grid is coarser than Q4_1's per-group one.
    bound = {"none": 1e-6, "int4": 1e-5, "int8": 2e-2}[mode]
    expected = x @ w.T
    assert (layer(x) - expected).abs().max() / expected.abs().max() < bound
    with pytest.raises(ValueError, match="unknown linear mode"):
        make_linear(w, None, "int2", torch.float32, pack=False)


def test_the_dense_copy_serves_many_rows_only_where_dense_gemms_are_fast() -> None:
    assert kernel_rows(torch.float32, pack=False) == MAX_KERNEL_ROWS
    assert kernel_rows(torch.bfloat16, pack=True) == MAX_KERNEL_ROWS
    # bf16 without oneDNN is emulated: the kernel serves every row count.
    assert kernel_rows(torch.bfloat16, pack=False) > 10**9
    layer = Int4Linear(torch.randn(64, 128) * 0.05, None, torch.bfloat16, False)
    assert layer.max_rows > 10**9
