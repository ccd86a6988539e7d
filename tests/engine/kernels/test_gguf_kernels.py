"""The native GGUF kernels against gguf-py's own dequantization: repacking loses nothing, products
are exactly W times the quantized activations (float rounding aside) on every instruction set this
CPU has, a row's result does not depend on its batch, and the fused norm, SwiGLU and residual are
the layer's own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from specgate.engine.kernels import extension
from tests.engine.gguf_fixture import quantize

pytestmark = pytest.mark.skipif(
    not extension.load(), reason=f"GGUF kernels unavailable: {extension.unavailable_reason()}"
)

BLOCK_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
K_TYPES = [T.Q4_K, T.Q5_K, T.Q6_K]
# Row lengths: whole superblocks, superblocks and a tail chunk, a tail of one block (32), tails only.
BLOCK_COLS = [256, 576, 288, 64, 96, 1536]
K_COLS = [256, 1536]


def ops():  # type: ignore[no-untyped-def]
    return extension.ops()


def blocks(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[:, ::7] *= 6  # a few heavier columns, as real weights have
    return quantize(w, qtype)


def packed(qtype: T, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    raw = blocks(qtype, rows, cols, seed)
    reference = quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float64)
    return ops().repack(torch.from_numpy(raw), int(qtype.value), cols), reference


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """What the kernels multiply by: each row in blocks of 32, int8 with one scale per block (codes
    rounded half to even from x * (127 / amax) in float32, as the kernels compute them), as float64."""
    x = x.float()
    out = torch.empty(x.shape, dtype=torch.float64)
    for start in range(0, x.shape[1], 32):
        v = x[:, start : start + 32]
        amax = v.abs().amax(dim=1, keepdim=True)
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        codes = torch.round(v * inv).clamp(-127, 127)
        out[:, start : start + 32] = codes.double() * (amax / 127).double()
    return out


@pytest.mark.parametrize("qtype", BLOCK_TYPES + K_TYPES, ids=lambda t: t.name)
def test_repacked_blocks_dequantize_to_the_files_values(qtype: T) -> None:
    for cols in K_COLS if qtype in K_TYPES else BLOCK_COLS:
        w, reference = packed(qtype, 23, cols)
        assert w.shape == (2, ops().packed_panel_bytes(int(qtype.value), cols))  # panels of 16 rows
        rows = ops().dequantize_rows(w, int(qtype.value), cols, 23, torch.arange(23)).double().numpy()
        np.testing.assert_array_equal(rows, reference.astype(np.float32).astype(np.float64))


@pytest.mark.parametrize("qtype", BLOCK_TYPES + K_TYPES, ids=lambda t: t.name)
def test_products_are_the_weights_times_the_quantized_activations(qtype: T, levels: list[int]) -> None:
    for cols in K_COLS if qtype in K_TYPES else BLOCK_COLS:
        w, reference = packed(qtype, 41, cols, seed=cols)
        x = torch.randn(6, cols, generator=torch.Generator().manual_seed(cols))
        exact = quantized_activations(x) @ torch.from_numpy(reference).T  # [6, 41]
        results = []
        for level in levels:
            ops().set_isa_level(level)
            y = ops().qmatmul(x, [w], [int(qtype.value)], [41], cols, [torch.empty(0)])
            assert y.dtype == torch.float32 and y.shape == (6, 41)
            err = float((y.double() - exact).abs().max() / exact.abs().max())
            assert err < 2e-6, (qtype.name, cols, level, err)
            results.append(y)
        for y in results[1:]:  # every instruction set computes the same numbers, to float rounding
            assert float((y - results[0]).abs().max() / results[0].abs().max()) < 2e-6


def test_activation_codes_round_half_to_even_alike_on_every_path(levels: list[int]) -> None:
    """Each path quantizes activations itself (AVX-512 sixteen at a time): ties, zeros, an all-zero
    block and the largest value come out as the same codes and scales. With identity weights each
    output is one code times its scales, so any difference shows."""
    eye = quantize(np.eye(64, dtype=np.float32), T.Q8_0)
    w = ops().repack(torch.from_numpy(eye), int(T.Q8_0.value), 64)
    x = torch.zeros(3, 64)
    x[0, :32] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -1.5, 126.5] * 4)  # scale 1: exact ties
    x[0, 32:] = torch.linspace(-3, 3, 32)
    x[1, :32] = torch.randn(32, generator=torch.Generator().manual_seed(9))
    x[2, 5] = -1e-30  # a block whose only value is tiny
    d = float(np.frombuffer(eye[0, :2].tobytes(), dtype=np.float16)[0])
    codes = torch.round(x[0, :8]).to(torch.float32)  # round half to even: 2, -4, 0, -0, 2, -2, 126
    expected = (codes * 127) * (np.float32(d) * np.float32(127.0 / 127.0))
    outputs = []
    for level in levels:
        ops().set_isa_level(level)
        outputs.append(ops().qmatmul(x, [w], [8], [64], 64, [torch.empty(0)]))
    assert torch.equal(outputs[0][0, :8], expected)
    assert outputs[0][2, 5] < 0
    for y in outputs[1:]:
        assert torch.equal(y, outputs[0])


def test_a_rows_result_does_not_depend_on_its_batch(levels: list[int]) -> None:
    w, _ = packed(T.Q4_K, 50, 512)
    w6, _ = packed(T.Q6_K, 30, 512)
    x = torch.randn(70, 512)  # past one sweep of the rows (64)
    for level in levels:
        ops().set_isa_level(level)
        alone = [
            ops().qmatmul(x[r : r + 1], [w, w6], [12, 14], [50, 30], 512, [torch.empty(0)] * 2)
            for r in range(70)
        ]
        for n in (2, 3, 4, 5, 6, 7, 8, 9, 13, 15, 16, 17, 64, 65, 70):
            batch = ops().qmatmul(x[:n], [w, w6], [12, 14], [50, 30], 512, [torch.empty(0)] * 2)
            for r in range(n):
                assert torch.equal(batch[r], alone[r][0]), (level, n, r)


def test_matrices_of_different_types_side_by_side_with_biases() -> None:
    q, rq = packed(T.Q4_K, 40, 256, seed=1)
    k, rk = packed(T.Q5_0, 8, 256, seed=2)
    v, rv = packed(T.Q6_K, 8, 256, seed=3)
    bias_q, bias_v = torch.randn(40), torch.randn(8)
    x = torch.randn(3, 256)
    y = ops().qmatmul(x, [q, k, v], [12, 6, 14], [40, 8, 8], 256, [bias_q, torch.empty(0), bias_v])
    xq = quantized_activations(x)
    expected = torch.cat(
        [
            xq @ torch.from_numpy(rq).T + bias_q.double(),
            xq @ torch.from_numpy(rk).T,
            xq @ torch.from_numpy(rv).T + bias_v.double(),
        ],
        dim=1,
    )
    assert float((y.double() - expected).abs().max() / expected.abs().max()) < 2e-6


def test_fused_norm_swiglu_and_residual_are_the_layers_own(levels: list[int]) -> None:
    w, _ = packed(T.Q4_K, 64, 512, seed=4)
    x, norm, residual = torch.randn(4, 512), torch.rand(512) + 0.5, torch.randn(4, 64)
    gate_up = torch.randn(4, 1024)
    e = [torch.empty(0)]
    for level in levels:
        ops().set_isa_level(level)
        normed = ops().qmatmul(x, [w], [12], [64], 512, e, norm, 1e-6, False, residual)
        by_hand = ops().qmatmul(torch.rms_norm(x, (512,), norm, 1e-6), [w], [12], [64], 512, e) + residual
        assert float((normed - by_hand).abs().max() / by_hand.abs().max()) < 1e-5
        gated = ops().qmatmul(gate_up, [w], [12], [64], 512, e, None, 0.0, True, None)
        swiglu = torch.nn.functional.silu(gate_up[:, :512]) * gate_up[:, 512:]
        expected = ops().qmatmul(swiglu, [w], [12], [64], 512, e)
        assert float((gated - expected).abs().max() / expected.abs().max()) < 1e-5
        # GeGLU (Gemma's gate, activation 2): GELU's tanh form, with gate values wide enough to reach
        # the exponential's clamp.
        wide = torch.cat([gate_up[:, :512] * 40, gate_up[:, 512:]], 1)
        geglu = ops().qmatmul(wide, [w], [12], [64], 512, e, None, 0.0, 2, None)
        by_torch = torch.nn.functional.gelu(wide[:, :512], approximate="tanh") * wide[:, 512:]
        expected = ops().qmatmul(by_torch, [w], [12], [64], 512, e)
        assert float((geglu - expected).abs().max() / expected.abs().max()) < 1e-5, level


def test_bfloat16_in_bfloat16_out() -> None:
    w, reference = packed(T.Q8_0, 16, 256)
    x = torch.randn(2, 256).bfloat16()
    y = ops().qmatmul(x, [w], [8], [16], 256, [torch.empty(0)])
    exact = quantized_activations(x.float()) @ torch.from_numpy(reference).T
    assert y.dtype == torch.bfloat16 and float((y.double() - exact).abs().max() / exact.abs().max()) < 1e-2


def test_misuse_is_refused_with_a_message() -> None:
    w, _ = packed(T.Q4_K, 8, 256)
    e = [torch.empty(0)]
    with pytest.raises(RuntimeError, match="packed panel bytes do not match"):
        ops().qmatmul(torch.randn(1, 512), [w], [12], [8], 512, e)
    with pytest.raises(RuntimeError, match="unsupported GGUF type"):
        ops().repack(torch.zeros(1, 84, dtype=torch.uint8), 10, 256)  # Q2_K: converted to Q8_0 first
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ops().repack(torch.zeros(1, 144, dtype=torch.uint8), 12, 288)
    with pytest.raises(RuntimeError, match="row id out of range"):
        ops().dequantize_rows(w, 12, 256, 8, torch.tensor([8]))
    with pytest.raises(RuntimeError, match="one type, output size and bias per matrix"):
        ops().qmatmul(torch.randn(1, 256), [w], [12, 12], [8], 256, e)


def test_an_empty_batch_is_an_empty_result() -> None:
    w, _ = packed(T.Q4_0, 8, 64)
    y = ops().qmatmul(torch.randn(0, 64), [w], [2], [8], 64, [torch.empty(0)])
    assert y.shape == (0, 8)
