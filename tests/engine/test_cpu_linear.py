"""oneDNN-prepacked linears: same math as nn.Linear, used for bf16 serving on CPU."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from specgate.engine.batch_layout import ForwardItem
from specgate.engine.cpu_linear import PackedLinear, pack_linears, packing_supported
from specgate.engine.engine import Engine

# Packing itself needs oneDNN (fp32 everywhere it exists); bf16 needs a CPU with native bf16.
pytestmark = pytest.mark.skipif(not packing_supported(torch.float32), reason="oneDNN unavailable")
needs_bf16 = pytest.mark.skipif(not packing_supported(torch.bfloat16), reason="this CPU has no native bf16")


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 50])
def test_packed_linear_matches_nn_linear(dtype: torch.dtype, bias: bool, rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 40, bias=bias).to(dtype)
    x = torch.randn(1, rows, 48, dtype=dtype)
    ref = torch.nn.functional.linear(
        x.float(), linear.weight.float(), None if not bias else linear.bias.float()
    )
    got = PackedLinear([linear])(x)
    assert got.shape == (1, rows, 40) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2 * ref.abs().max().item()
    assert (got.float() - ref).abs().max().item() <= tol


def test_pack_linears_replaces_every_linear() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    x = torch.randn(3, 8)
    ref = model(x)
    assert pack_linears(model) == 2
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert torch.allclose(model(x), ref, atol=1e-5)


@needs_bf16
def test_bf16_engine_packs_by_default_and_tracks_unpacked_logits(make_engine: Callable[..., Engine]) -> None:
    packed = make_engine(dtype="bfloat16")
    plain = make_engine(dtype="bfloat16", pack_linears=False)
    assert packed.config.pack_linears and any(
        isinstance(m, PackedLinear) for m in packed.runner.model.modules()
    )
    assert not any(isinstance(m, PackedLinear) for m in plain.runner.model.modules())
    prompt = list(range(5, 45))
    logits = [e.runner.execute([ForwardItem(prompt, 0, list(range(10)), 3)]) for e in (packed, plain)]
    assert logits[0].shape == (3, 96)
    scale = logits[1].float().abs().max().item()
    assert (logits[0].float() - logits[1].float()).abs().max().item() <= 0.05 * scale
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


def test_fp32_engine_with_packed_linears_matches_the_plain_engine(make_engine: Callable[..., Engine]) -> None:
    """Where bf16 is emulated, packing still runs (in fp32): the same logits as torch's kernels."""
    packed = make_engine(pack_linears=True)
    plain = make_engine()
    assert any(isinstance(m, PackedLinear) for m in packed.runner.model.modules())
    prompt = list(range(5, 45))
    logits = [e.runner.execute([ForwardItem(prompt, 0, list(range(10)), 3)]) for e in (packed, plain)]
    assert torch.allclose(logits[0], logits[1], atol=1e-4, rtol=1e-4)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(16, 16, bias=True)
        self.k_proj = nn.Linear(16, 8, bias=False)
        self.v_proj = nn.Linear(16, 8, bias=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], dim=-1)


def test_same_input_siblings_are_fused_into_one_gemm() -> None:
    torch.manual_seed(0)
    block = _Attention()
    k_weight = block.k_proj.weight.detach().clone()
    h = torch.randn(1, 5, 16)
    ref = block(h)
    assert pack_linears(block) == 3
    fused = block.q_proj.fused
    assert fused.out_features == 32 and block.v_proj.fused is fused
    assert sum(1 for m in block.modules() if isinstance(m, PackedLinear)) == 1  # one weight copy
    assert torch.allclose(block(h), ref, atol=1e-5)
    # A different input is recomputed, never served from the previous call's output.
    h2 = torch.randn(1, 5, 16)
    assert torch.allclose(block.k_proj(h2), torch.nn.functional.linear(h2, k_weight), atol=1e-5)


def test_packed_linear_reads_a_strided_input_right() -> None:
    if not packing_supported(torch.bfloat16):
        pytest.skip("oneDNN cannot pack bf16 on this CPU")
    torch.manual_seed(0)
    lin = nn.Linear(64, 32).bfloat16().requires_grad_(False)
    x = torch.randn(10, 128).bfloat16()[:, :64]  # [10, 64], rows 128 apart
    assert not x.is_contiguous()
    assert torch.allclose(PackedLinear([lin])(x).float(), lin(x).float(), atol=1e-2)
