"""The native rotary / KV-store and paged attention ops against torch: rotation and stores exactly
the tensor expression's, attention SDPA's over the visible keys (decodes of different lengths,
verification rows, tree masks, grouped-query heads, float32 and bfloat16 pools) on every
instruction set this CPU has, and a query's result independent of the rest of its batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specgate.engine.kernels import extension

pytestmark = pytest.mark.skipif(
    not extension.load(), reason=f"GGUF kernels unavailable: {extension.unavailable_reason()}"
)


def ops():  # type: ignore[no-untyped-def]
    return extension.ops()


def pools(
    layers: int, kv: int, slots: int, d: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, kv, slots, d, generator=g).to(dtype)
    v = torch.randn(layers, kv, slots, d, generator=g).to(dtype)
    return k, v


def reference(
    q: torch.Tensor,  # [N, h, d]
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    layer: int,
    kv_slots: torch.Tensor,  # [b, S]
    rows: torch.Tensor,  # [b * t]
    mask: torch.Tensor | None,  # [b, t, S]
    t: int,
    scale: float,
) -> torch.Tensor:
    b, s = kv_slots.shape
    h = q.shape[1]
    k = (
        k_pool[layer].float()[:, kv_slots.flatten()].view(-1, b, s, q.shape[2]).transpose(0, 1)
    )  # [b, kv, S, d]
    v = v_pool[layer].float()[:, kv_slots.flatten()].view(-1, b, s, q.shape[2]).transpose(0, 1)
    qs = q[rows].view(b, t, h, -1).transpose(1, 2).double()  # [b, h, t, d]
    m = None if mask is None else mask.unsqueeze(1)
    o = F.scaled_dot_product_attention(qs, k.double(), v.double(), attn_mask=m, scale=scale, enable_gqa=True)
    return o.transpose(1, 2).reshape(b * t, h, -1)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv", "d"), [(9, 3, 64), (4, 4, 32), (6, 2, 24), (12, 2, 128)])
def test_attention_is_sdpa_over_the_visible_keys(
    levels: list[int], pool_dtype: torch.dtype, heads: int, kv: int, d: int
) -> None:
    k_pool, v_pool = pools(2, kv, 129, d, pool_dtype)
    g = torch.Generator().manual_seed(1)
    n, b, t, s = 14, 3, 4, 40
    q = torch.randn(n, heads, d, generator=g)
    kv_slots = torch.randperm(128, generator=g)[: b * s].view(b, s)
    lengths = torch.tensor([40, 17, 5])  # ragged contexts: the rest is padding
    positions = lengths.view(b, 1) - t + torch.arange(t).view(1, t)  # the last t tokens of each
    mask = torch.arange(s).view(1, 1, s) <= positions.clamp(min=0).unsqueeze(-1)  # [b, t, S]
    mask[2, 1, 0] = False  # a tree-like hole: an ancestor left out
    rows = torch.tensor([2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 12])  # the last query padded by repeating
    for level in levels:
        ops().set_isa_level(level)
        got = ops().paged_attend(q, k_pool, v_pool, 1, kv_slots, 0, rows, mask, t, d**-0.5)
        want = reference(q, k_pool, v_pool, 1, kv_slots, rows, mask, t, d**-0.5)
        assert torch.allclose(got.double(), want, atol=2e-5, rtol=1e-4), (level, (got - want).abs().max())
    # Rows given by their start (no index) and no mask: one decode over its whole context.
    got = ops().paged_attend(
        q, k_pool, v_pool, 0, kv_slots[:1], 5, torch.empty(0, dtype=torch.long), None, 1, 0.3
    )
    want = reference(q, k_pool, v_pool, 0, kv_slots[:1], torch.tensor([5]), None, 1, 0.3)
    assert torch.allclose(got.double(), want, atol=2e-5, rtol=1e-4)


def test_a_querys_result_does_not_depend_on_its_batch(levels: list[int]) -> None:
    k_pool, v_pool = pools(1, 2, 200, 64, torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(8, 8, 64, generator=g)
    slots = torch.arange(150).view(1, 150)
    for level in levels:
        ops().set_isa_level(level)
        alone = ops().paged_attend(
            q, k_pool, v_pool, 0, slots, 3, torch.empty(0, dtype=torch.long), None, 1, 0.125
        )
        # The same sequence beside a longer one, its keys padded with another slot and masked off.
        both = torch.cat([torch.cat([slots, torch.full((1, 50), 199)], 1), torch.arange(200).view(1, 200)])
        mask = torch.ones(2, 1, 200, dtype=torch.bool)
        mask[0, 0, 150:] = False
        rows = torch.tensor([3, 6])
        batched = ops().paged_attend(q, k_pool, v_pool, 0, both, 0, rows, mask, 1, 0.125)
        assert torch.equal(batched[0], alone[0])


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qkv_dtype", [torch.float32, torch.bfloat16])
def test_rotation_and_stores_are_the_tensor_expressions(
    pool_dtype: torch.dtype, qkv_dtype: torch.dtype
) -> None:
    heads, kv, d, n = 6, 2, 32, 5
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(n, (heads + 2 * kv) * d, generator=g).to(qkv_dtype)
    cos, sin = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    k_pool, v_pool = torch.zeros(3, kv, 20, d, dtype=pool_dtype), torch.zeros(3, kv, 20, d, dtype=pool_dtype)
    slots = torch.tensor([7, 0, 19, 3, 11])
    q = ops().rope_store(qkv, cos, sin, k_pool, v_pool, 2, slots, heads, kv)
    x = qkv.float().view(n, heads + 2 * kv, d).transpose(0, 1)  # [units, n, d]
    qk = x[: heads + kv]
    rotated = qk * cos + torch.roll(qk, d // 2, dims=-1) * sin
    assert torch.equal(q, rotated[:heads].transpose(0, 1))
    assert torch.equal(k_pool[2][:, slots], rotated[heads:].to(pool_dtype))
    assert torch.equal(v_pool[2][:, slots], x[heads + kv :].to(pool_dtype))
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots] = False
    assert not k_pool[:2].any() and not k_pool[2][:, untouched].any() and not v_pool[2][:, untouched].any()


def test_misuse_is_refused_with_a_message() -> None:
    k_pool, v_pool = pools(1, 2, 10, 16, torch.float32)
    q = torch.randn(2, 4, 16)
    none = torch.empty(0, dtype=torch.long)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops().paged_attend(q, k_pool, v_pool, 0, torch.tensor([[10]]), 0, none, None, 1, 1.0)
    with pytest.raises(RuntimeError, match="query row out of range"):
        ops().paged_attend(q, k_pool, v_pool, 0, torch.tensor([[1]]), 2, none, None, 1, 1.0)
    with pytest.raises(RuntimeError, match="layer out of range"):
        ops().paged_attend(q, k_pool, v_pool, 1, torch.tensor([[1]]), 0, none, None, 1, 1.0)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops().rope_store(torch.randn(1, 128), torch.ones(1, 16), torch.ones(1, 16), k_pool, v_pool, 0,
                         torch.tensor([10]), 4, 2)  # fmt: skip
