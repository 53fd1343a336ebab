import os

import pytest
import torch

from agentkv.cache import DEAD, KVPool, PoolLayout, Precision
from agentkv.kernels import (
    INT2_PAGE,
    KVPools,
    dequantize_int2_keys_ref,
    dequantize_int2_values_ref,
    dequantize_int4_ref,
    quantize_int2_keys_ref,
    quantize_int2_values_ref,
    quantize_int4_ref,
)

L, H, D = 2, 2, 32
LAYOUT = PoolLayout(full_slots=40, int4_slots=8, int2_pages=2)


def pool(dtype=torch.float32):
    return KVPool(L, H, D, LAYOUT, dtype=dtype)


def test_buffers_shapes_and_bytes():
    p = pool(torch.bfloat16)
    assert len(p.layers) == L
    lay = p.layers[0]
    assert lay.full.k.shape == (40, H, D) and lay.full.k.dtype == torch.bfloat16
    assert lay.int4.k.shape == (8, H, D // 2) and lay.int2.k.shape == (2, H, INT2_PAGE, D // 4)
    assert (lay.int4_base, lay.int2_base) == (LAYOUT.int4_base, LAYOUT.int2_base)
    cb = p.cell_bytes
    assert cb[Precision.FULL] == 2 * D * 2
    assert cb[Precision.INT4] == 2 * (D // 2 + 2 * 2)  # codes + fp16 scale and zero per group
    # INT2: keys (codes + per-channel scale/zero shared by the page), values per token
    assert cb[Precision.INT2] == pytest.approx(D // 4 + 2 * D * 2 / INT2_PAGE + D // 4 + 4)
    assert cb[Precision.FULL] > cb[Precision.INT4] > cb[Precision.INT2]
    # the per-layer pools agree with the per-cell view
    per_tok = lay.bytes_per_token()
    assert per_tok["full"] == H * cb[Precision.FULL] and per_tok["int4"] == H * cb[Precision.INT4]
    assert per_tok["int2"] == pytest.approx(H * cb[Precision.INT2])
    assert p.bytes_per_token == L * H * cb[Precision.FULL]
    full = 2 * 40 * H * D * 2
    int4 = 2 * 8 * H * (D // 2) + 4 * 8 * H * (D // 32) * 2
    int2 = 2 * 2 * H * INT2_PAGE * (D // 4) + 2 * 2 * H * D * 2 + 2 * 2 * H * INT2_PAGE * 2
    assert p.total_bytes == L * (full + int4 + int2)


def test_write_gather_roundtrip_per_head_cells():
    """Each (layer, head) column addresses its own cells: the same id in two heads is two
    different cells."""
    p = pool()
    cells = torch.tensor([[5, 2, 7], [2, 9, 5]])  # [H, n]: head 1 reuses ids of head 0
    k = torch.randn(3, H, D)
    v = torch.randn(3, H, D)
    p.write(1, cells, k, v)
    gk, gv = p.gather(1, cells)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    # swap the order per head; DEAD reads zeros
    sel = torch.tensor([[7, DEAD], [DEAD, 2]])
    gk, gv = p.gather(1, sel)
    assert torch.equal(gk[0, 0], k[2, 0]) and torch.equal(gk[1, 1], k[0, 1])
    assert bool((gk[1, 0] == 0).all()) and bool((gv[0, 1] == 0).all())
    assert torch.count_nonzero(p.layers[0].full.k) == 0  # other layer untouched


def test_write_rejects_bad_shapes():
    p = pool()
    with pytest.raises(ValueError, match="must be"):
        p.write(0, torch.tensor([[1], [2]]), torch.ones(1, 1, D), torch.ones(1, 1, D))
    with pytest.raises(ValueError, match="must be"):
        p.write(0, torch.tensor([[1], [2]]), torch.ones(1, H, D), torch.ones(2, H, D))


def test_demote_int4_matches_the_reference_quantizer_and_leaves_the_source():
    p = pool()
    src = torch.tensor([[3, 4, 5], [3, 8, 1]])
    k, v = torch.randn(3, H, D), torch.randn(3, H, D)
    p.write(0, src, k, v)
    # head 1 demotes positions 0 and 2, head 0 position 1
    heads = torch.tensor([1, 1, 0])
    s = torch.tensor([3, 1, 4])
    dst = LAYOUT.int4_base + torch.tensor([0, 5, 0])  # the same INT4 row id in two heads
    p.demote(torch.zeros_like(heads), heads, s, dst, Precision.INT4)
    cells = torch.tensor([[DEAD, int(dst[2]), DEAD], [int(dst[0]), DEAD, int(dst[1])]])
    gk, gv = p.gather(0, cells)
    for i, (h, t) in enumerate([(1, 0), (1, 2), (0, 1)]):
        pos = t
        col = cells[h].tolist().index(int(dst[i]))
        assert col == pos
        want_k = dequantize_int4_ref(*quantize_int4_ref(k[t, h]))
        want_v = dequantize_int4_ref(*quantize_int4_ref(v[t, h]))
        assert torch.equal(gk[pos, h], want_k) and torch.equal(gv[pos, h], want_v)
        assert float((gk[pos, h] - k[t, h]).abs().max()) < 0.5  # quantized, not garbage
    # quantizing reads the full cell; it does not change it
    fk, fv = p.gather(0, src)
    assert torch.equal(fk, k) and torch.equal(fv, v)


def test_demote_int2_pages_per_head():
    p = pool()
    n = INT2_PAGE
    src = torch.stack([torch.arange(1, n + 1), torch.arange(2, n + 2)])  # [H, 32]
    k, v = torch.randn(n, H, D), torch.randn(n, H, D)
    p.write(1, src, k, v)
    rows = LAYOUT.int2_base + INT2_PAGE + torch.arange(INT2_PAGE)  # page 1 of head 1
    p.demote(torch.tensor([1]), torch.tensor([1]), src[1:], rows[None, :], Precision.INT2)
    cells = torch.stack([torch.full((n,), DEAD), rows])
    gk, gv = p.gather(1, cells)
    kp = k[:, 1][None, :, None, :]  # [1 page, 32, 1 head, D]
    vp = v[:, 1][None, :, None, :]
    want_k = dequantize_int2_keys_ref(*quantize_int2_keys_ref(kp))[0, 0]
    want_v = dequantize_int2_values_ref(*quantize_int2_values_ref(vp))[0, 0]
    assert torch.equal(gk[:, 1], want_k) and torch.equal(gv[:, 1], want_v)
    assert bool((gk[:, 0] == 0).all())
    assert torch.count_nonzero(p.layers[1].int2.k[:, 0]) == 0  # head 0's pages untouched
    with pytest.raises(ValueError):
        p.demote(torch.tensor([1]), torch.tensor([0]), src[:1], rows[None, :], Precision.FULL)


def test_layers_are_views_of_one_stack_laid_out_as_the_kernels_allocate():
    """Each layer's pools are views ``[l]`` of the stacked buffers, with the layout of
    ``KVPools.allocate(int4_head_major=True)``: head-major INT4 rows, scales interleaved."""
    p = pool(torch.bfloat16)
    ref = KVPools.allocate(40, 8, 2, H, D, torch.bfloat16, int4_head_major=True)
    for layer, lay in enumerate(p.layers):
        assert lay.int4.row_map() == ref.int4.row_map()
        assert lay.int4.head_major and lay.int4.scales_interleaved
        assert lay.layout_key() == ref.layout_key()
        assert lay.full.k.data_ptr() == p.stack.full_k[layer].data_ptr()
        assert lay.int2.v_zero.data_ptr() == p.stack.int2_v_zero[layer].data_ptr()


def test_demote_and_move_across_layers_in_one_call_equal_per_layer_calls():
    """One call over cells of every layer writes what a call per layer writes (INT4 with
    key channel scales on one layer only, INT2 pages, INT4 moves)."""
    g = torch.Generator().manual_seed(3)
    pools = [pool(), pool()]
    src = torch.arange(1, 33).expand(H, 32)
    absmax = torch.rand(H, D, generator=g) * 8
    for layer in range(L):
        k, v = torch.randn(2, 32, H, D, generator=g)
        for p in pools:
            p.write(layer, src, k, v)
    for p in pools:
        p.set_key_channel_scales(1, absmax)
    layers = torch.tensor([0, 1, 1, 0, 1])
    heads = torch.tensor([1, 0, 1, 0, 0])
    s4 = torch.tensor([3, 3, 7, 9, 30])
    d4 = LAYOUT.int4_base + torch.tensor([0, 0, 2, 5, 1])
    pages = torch.tensor([[0, 1], [1, 0]])  # (layer, head) of each page
    s2 = torch.arange(1, 33).expand(2, 32)
    d2 = LAYOUT.int2_base + torch.tensor([0, INT2_PAGE])[:, None] + torch.arange(INT2_PAGE)
    one, per = pools
    one.demote(layers, heads, s4, d4, Precision.INT4)
    one.demote(pages[:, 0], pages[:, 1], s2, d2, Precision.INT2)
    one.move_int4(layers, heads, d4, d4 + 2)
    for layer in range(L):
        sel, psel = layers == layer, pages[:, 0] == layer
        per.demote(layers[sel], heads[sel], s4[sel], d4[sel], Precision.INT4)
        per.demote(pages[psel, 0], pages[psel, 1], s2[psel], d2[psel], Precision.INT2)
        per.move_int4(layers[sel], heads[sel], d4[sel], d4[sel] + 2)
    for name, t in vars(one.stack).items():
        assert torch.equal(t, getattr(per.stack, name)), name
    # the channel scales reached layer 1's INT4 keys only: layer 0's codes as without them
    plain = pool()
    plain.write(0, src, *torch.stack([one.stack.full_k[0, 1:33], one.stack.full_v[0, 1:33]]))
    sel = layers == 0
    plain.demote(layers[sel], heads[sel], s4[sel], d4[sel], Precision.INT4)
    rows = d4[sel] - LAYOUT.int4_base  # (a move copies: the demoted rows stay)
    assert torch.equal(
        plain.stack.int4_k[0, heads[sel], rows], one.stack.int4_k[0, heads[sel], rows]
    )
    assert one.layers[1].int4.k_channel is not None and one.layers[0].int4.k_channel is None


def test_head_dim_that_cannot_quantize_works_without_quantized_pools():
    p = KVPool(1, 1, 4, PoolLayout(5))
    assert p.layers[0].int4 is None and p.layers[0].int2 is None
    p.write(0, torch.tensor([[3]]), torch.ones(1, 1, 4), -torch.ones(1, 1, 4))
    k, v = p.gather(0, torch.tensor([[3, DEAD]]))
    assert k[:, 0].tolist() == [[1.0] * 4, [0.0] * 4] and float(v.sum()) == -4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pool_on_cuda():
    p = KVPool(1, 1, 32, PoolLayout(4, 2, 1), dtype=torch.float16, device="cuda")
    assert p.backend == "triton"
    p.write(0, torch.tensor([[3]]), torch.ones(1, 1, 32), torch.ones(1, 1, 32))
    k, _ = p.gather(0, torch.tensor([[3]]))
    assert k.device.type == "cuda" and float(k.sum()) == 32.0


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton gather needs CUDA or TRITON_INTERPRET=1",
)
def test_triton_gather_matches_torch_on_mixed_per_head_cells():
    """The store's gather path (``[Hkv, n]`` int64 cells -> ``dequant_gather(per_head=True)``
    with the default GatherConfig): full, INT4, INT2 and DEAD cells mixed per head, the same
    bits as the torch backend."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    p = KVPool(L, H, D, LAYOUT, dtype=torch.float32, device=dev, backend="triton")
    g = torch.Generator().manual_seed(0)
    n = INT2_PAGE
    src = torch.stack([torch.arange(1, n + 1), torch.arange(3, n + 3)])  # [H, 32]
    k, v = torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)
    p.write(0, src, k, v)
    rows = LAYOUT.int2_base + torch.arange(INT2_PAGE)  # page 0 of head 0
    p.demote(torch.tensor([0]), torch.tensor([0]), src[:1], rows[None, :], Precision.INT2)
    dst = LAYOUT.int4_base + torch.arange(4)  # INT4 rows 0-3 of head 1
    p.demote(
        torch.zeros(4, dtype=torch.int64),
        torch.ones(4, dtype=torch.int64),
        src[1, :4],
        dst,
        Precision.INT4,
    )
    p.write(0, torch.tensor([[35], [36]]), torch.randn(1, H, D, generator=g), -k[:1])
    cells = torch.tensor(
        [
            [*rows[:4].tolist(), DEAD, 35, *rows[4:6].tolist(), DEAD],  # INT2, full, DEAD
            [*dst[:3].tolist(), DEAD, int(src[1, 5]), 36, int(dst[3]), int(src[1, 9]), DEAD],
        ]
    )
    kt, vt = p.gather(0, cells)
    p.backend = "torch"
    kr, vr = p.gather(0, cells)
    assert kt.shape == (9, H, D) and kt.device.type == torch.device(dev).type
    assert torch.equal(kt, kr) and torch.equal(vt, vr)
    dead = (cells.t() == DEAD).to(kt.device)  # [n, Hkv]
    assert bool((kt[dead] == 0).all()) and bool((kt[~dead].abs().sum(-1) > 0).all())
