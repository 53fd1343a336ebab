"""DecodeIndex: a request's cells per (layer, KV head) in the decode kernel's segment order.
Decoding over it (the kernels' torch reference, the CPU path) equals dense attention over
what ``read_kv`` returns."""

import math

import pytest
import torch

from agentkv.cache import DEAD, DecodeIndex, KVStore, Precision
from agentkv.kernels import INT2_PAGE, decode_attention_ref, validate_decode_inputs

from .kv_fill import fill

L, H, D, G = 2, 2, 32, 2  # G query heads per KV head
P4, P2 = int(Precision.INT4), int(Precision.INT2)


def dense_attention(st, req, layer, q):
    """softmax(q . k) v over the live cells ``read_kv`` returns; q ``[H * G, D]``."""
    k, v, _, hm = st.read_kv(req, layer)  # [n, H, D]
    live = torch.ones(H, k.shape[0], dtype=torch.bool) if hm is None else hm
    qg = q.view(H, G, D)
    s = torch.einsum("hgd,nhd->hgn", qg, k) / math.sqrt(D)
    s = s.masked_fill(~live[:, None, :], float("-inf"))
    return torch.einsum("hgn,nhd->hgd", torch.softmax(s, dim=-1), v).reshape(H * G, D)


def mixed_request(st):
    req = st.begin_request(None, list(range(1, 46)))
    fill(st, req, st.extend(req))
    prec = torch.full((L, H, 45), 16, dtype=torch.int8)
    prec[0, :, :40] = P2  # layer 0: a page of 32, 8 leftovers to INT4
    prec[1, 1, 10:20] = P4
    st.set_precision(req, prec)
    keep = torch.ones(L, H, 45, dtype=torch.bool)
    keep[0, 0, [3, 17, 35, 44]] = False  # holes in an INT2 page, an INT4 cell, a full cell
    keep[1, :, 12] = False
    st.evict_per_head(req, keep)
    return req


def test_segments_hold_each_columns_live_cells_in_kernel_order():
    st = KVStore(L, H, D, num_slots=64)
    req = mixed_request(st)
    idx = DecodeIndex.build(req.slot_map, st.layout, room=4, device="cpu")
    assert idx.slot_map.shape[:2] == (L, H) and idx.seq_lens.shape == (L, H)
    lay = st.layout
    for layer in range(L):
        pools = st.pool.layers[layer]
        validate_decode_inputs(
            pools, idx.slot_map[layer][None], idx.seq_lens[layer][None],
            idx.int2_lens[layer][None], idx.int4_lens[layer][None],
        )  # fmt: skip
        for h in range(H):
            n = int(idx.seq_lens[layer, h])
            row = idx.slot_map[layer, h, :n].long()
            live = req.slot_map.layer_slots(layer)[h]
            live = live[live != DEAD]
            assert sorted(row[row != DEAD].tolist()) == sorted(live.tolist())
            n2, n4 = int(idx.int2_lens[layer, h]), int(idx.int4_lens[layer, h])
            assert n2 % INT2_PAGE == 0
            pr = lay.precision(row)
            assert bool((pr[:n2][row[:n2] != DEAD] == P2).all())
            assert bool((pr[n2 : n2 + n4] == P4).all()) and bool((pr[n2 + n4 :] == 16).all())
    assert (int(idx.int2_lens[0, 0]), int(idx.int4_lens[0, 0])) == (32, 7)
    assert int((idx.slot_map[0, 0, :32] == DEAD).sum()) == 2  # page rows evicted: holes
    assert idx.longest == int(idx.seq_lens.max())
    assert idx.max_lens.int2 == 32 and idx.max_lens.full >= int(idx.seq_lens.max()) - 32
    st.finish_request(req, cache=False)


def test_decode_over_the_index_equals_dense_attention_and_follows_decode_steps():
    st = KVStore(L, H, D, num_slots=64)
    req = mixed_request(st)
    idx = DecodeIndex.build(req.slot_map, st.layout, room=2, device="cpu")
    g = torch.Generator().manual_seed(0)

    def check():
        for layer in range(L):
            q = torch.randn(H * G, D, generator=g)
            out = decode_attention_ref(
                q[None], st.pool.layers[layer], idx.slot_map[layer][None], idx.seq_lens[layer][None]
            )[0]
            torch.testing.assert_close(
                out, dense_attention(st, req, layer, q), atol=1e-5, rtol=1e-5
            )

    check()
    for t in (90, 91):  # decode steps append one full cell per column in place
        cells = st.extend(req, [t])
        fill(st, req, cells)
        before = idx.seq_lens.clone()
        idx.append(cells)
        assert torch.equal(idx.seq_lens, before + 1)
        last = idx.slot_map.gather(2, before.long()[:, :, None])[:, :, 0]
        assert torch.equal(last.reshape(-1).long(), cells[:, 0])
        check()
    with pytest.raises(RuntimeError, match="full"):
        idx.append(st.extend(req, [92]))  # room was 2
    st.finish_request(req, cache=False)


def _index_by_columns(cells, layout, room):
    """The index one column at a time (the plain reference of the vectorized build): per
    column, its INT2 pages in page order (32 entries each, DEAD where a row is gone), its
    INT4 cells in id order, its full cells in position order."""
    rows, n2s, n4s = [], [], []
    for row in cells:
        ids2 = row[row >= layout.int2_base]
        off = ids2 - layout.int2_base
        pages = torch.unique(off // INT2_PAGE)
        seg2 = torch.full((pages.numel() * INT2_PAGE,), DEAD, dtype=torch.int64)
        seg2[torch.searchsorted(pages, off // INT2_PAGE) * INT2_PAGE + off % INT2_PAGE] = ids2
        seg4 = row[(row >= layout.int4_base) & (row < layout.int2_base)].sort().values
        segf = row[(row != DEAD) & (row < layout.int4_base)]
        rows.append(torch.cat([seg2, seg4, segf]))
        n2s.append(seg2.numel())
        n4s.append(seg4.numel())
    cap = max(r.numel() for r in rows) + max(room, 1)
    sm = torch.full((len(rows), cap), DEAD, dtype=torch.int32)
    for c, r in enumerate(rows):
        sm[c, : r.numel()] = r.to(torch.int32)
    return sm, [r.numel() for r in rows], n2s, n4s


@pytest.mark.parametrize("seed", range(4))
def test_vectorized_build_matches_the_column_by_column_index(seed):
    """Random mixes (INT2 pages with evicted rows, INT4 spans demoted apart, full cells,
    evictions per head) give the index the plain per-column construction gives."""
    g = torch.Generator().manual_seed(seed)
    st = KVStore(L, H, D, 512)
    req = st.begin_request(None, list(range(1, 301)))
    fill(st, req, st.extend(req))
    for span in ((0, 96), (150, 230)):  # INT2 pages, then INT4 spans in two calls
        prec = torch.full((L, H, span[1]), 16, dtype=torch.int8)
        choice = torch.randint(0, 3, (L, H, 1), generator=g)
        prec[..., span[0] : span[1]] = torch.tensor([16, P4, P2], dtype=torch.int8)[choice]
        st.set_precision(req, prec, int2_leftover="int4")
    st.set_precision(req, torch.full((L, H, 120), P4, dtype=torch.int8))
    st.evict_per_head(req, torch.rand(L, H, 300, generator=g) < 0.7)
    ix = DecodeIndex.build(req.slot_map, st.layout, 16, "cpu")
    sm, lens, n2, n4 = _index_by_columns(req.slot_map.slots, st.layout, 16)
    assert torch.equal(ix.slot_map.view(L * H, -1), sm)
    assert ix.seq_lens.view(-1).tolist() == lens and ix.longest == max(lens)
    assert ix.int2_lens.view(-1).tolist() == n2 and ix.int4_lens.view(-1).tolist() == n4
    nf = [t - a - b for t, a, b in zip(lens, n2, n4, strict=True)]
    bounds = ix.max_lens
    assert (bounds.int2, bounds.int4, bounds.full) == (max(n2), max(n4), max(nf) + 16)
    assert sum(n2) > 0 and sum(n4) > 0  # (the mix has both)
    st.finish_request(req, cache=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_over_a_cuda_stores_pools_equal_the_reference():
    """On the GPU, a store's own pools (stacked over layers, fp16) after a bulk INT4
    demotion, INT2 pages, decode-time INT4 pages on a window (the index following them in
    place reads what a rebuilt one does), per-head eviction and INT4 compaction: the fused
    decode kernels over its index equal the torch reference on the same quantized values
    (the issue's bound, 1e-3 relative), every layer."""
    from agentkv.kernels import decode_attention

    Lg, Hg, Dg, Gg, n = 3, 8, 128, 4, 2048
    st = KVStore(Lg, Hg, Dg, 4096, dtype=torch.float16, device="cuda", int4_min_density=0.75)
    req = st.begin_request(None, [i % 997 + 1 for i in range(n)])
    cells = st.extend(req)
    g = torch.Generator().manual_seed(7)
    for layer in range(Lg):
        k, v = torch.randn(2, n, Hg, Dg, generator=g)
        st.write_kv(layer, st.layer_cells(cells, layer), k, v)
    prec = torch.full((Lg, 1, n - 256), P4, dtype=torch.int8)
    prec[1, :, :1024] = P2  # layer 1: INT2 pages, then INT4
    st.set_precision(req, prec)
    followed = DecodeIndex.build(req.slot_map, st.layout, 8, "cuda")
    for p in range(4):  # the engine's decode-time pages, the index following them in place
        page = torch.full((32,), P4, dtype=torch.int8)
        start = n - 256 + 32 * p
        st.set_precision(req, page, int2_leftover="full", start=start)
        assert followed.advance(req.slot_map, st.layout, start, start + 32)
    rebuilt = DecodeIndex.build(req.slot_map, st.layout, 8, "cuda")
    for layer in range(Lg):  # the same cells: the same attention, within summation order
        q = torch.randn(1, Hg * Gg, Dg, generator=g).to("cuda", torch.float16)
        out = [
            decode_attention(
                q, st.pool.layers[layer], ix.slot_map[layer][None], ix.seq_lens[layer][None],
                int2_lens=ix.int2_lens[layer][None], int4_lens=ix.int4_lens[layer][None],
                max_lens=ix.max_lens,
            ).float()
            for ix in (followed, rebuilt)
        ]  # fmt: skip
        assert float((out[0] - out[1]).norm() / out[1].norm()) < 1e-3
    st.evict_per_head(req, torch.rand(Lg, Hg, n, generator=g) < 0.6)
    assert st.compact_int4(req).cells_moved > 0
    st.check_invariants()
    idx = DecodeIndex.build(req.slot_map, st.layout, 8, "cuda")
    for layer in range(Lg):
        q = torch.randn(1, Hg * Gg, Dg, generator=g).to("cuda", torch.float16)
        args = (q, st.pool.layers[layer], idx.slot_map[layer][None], idx.seq_lens[layer][None])
        lens = dict(int2_lens=idx.int2_lens[layer][None], int4_lens=idx.int4_lens[layer][None])
        out = decode_attention(*args, **lens, max_lens=idx.max_lens).float()
        ref = decode_attention_ref(*args).float()
        err = float((out - ref).norm() / ref.norm())
        assert err < 1e-3, (layer, err)
    st.finish_request(req, cache=False)


def _segments(idx, layout):
    """Per column: (INT2 entries, sorted INT4 cells, full cells in order), lengths."""
    out = []
    L_, H_, _ = idx.slot_map.shape
    for layer in range(L_):
        for h in range(H_):
            n = int(idx.seq_lens[layer, h])
            n2, n4 = int(idx.int2_lens[layer, h]), int(idx.int4_lens[layer, h])
            row = idx.slot_map[layer, h, :n].long()
            out.append(
                (row[:n2].tolist(), sorted(row[n2 : n2 + n4].tolist()), row[n2 + n4 :].tolist())
            )
    return out


def _advance_setup(n=150, cut=64, keep=None):
    st = KVStore(L, H, D, num_slots=512)
    req = st.begin_request(None, [i % 50 + 1 for i in range(n)])
    fill(st, req, st.extend(req))
    if keep is not None:
        st.evict_per_head(req, keep)
    st.set_precision(req, torch.full((cut,), P4, dtype=torch.int8))
    return st, req


@pytest.mark.parametrize(
    ("precision", "holes"),
    [(P4, False), (P4, True), (P2, False)],
    ids=["int4", "int4-holes", "int2"],
)
def test_advance_follows_decode_time_pages_as_a_rebuild_would(precision, holes):
    """A decode-time page (INT4; INT2: whole pages joining the INT2 segment, the INT4 one
    shifting past them), followed in place (``advance``), gives the index a rebuild gives
    (segments as sets, lengths, and the reference decode over it), page after page with
    decode steps between, per-head holes in INT4 pages included; the bounds stay upper
    bounds."""
    g = torch.Generator().manual_seed(2)
    keep = torch.rand(L, H, 220, generator=g) > 0.3 if holes else None
    st, req = _advance_setup(n=220, keep=keep)
    if precision == P2:  # INT2 pages from the plan too (the INT2 segment is not empty)
        st.set_precision(req, torch.full((32,), P2, dtype=torch.int8), start=64)
    idx = DecodeIndex.build(req.slot_map, st.layout, room=40, device="cpu")
    start, t = 96 if precision == P2 else 64, 220
    for step in range(3):
        page = torch.full((32,), precision, dtype=torch.int8)
        st.set_precision(req, page, int2_leftover="full", start=start)
        assert idx.advance(req.slot_map, st.layout, start, start + 32)
        ref = DecodeIndex.build(req.slot_map, st.layout, room=40, device="cpu")
        assert _segments(idx, st.layout) == _segments(ref, st.layout)
        assert torch.equal(idx.seq_lens, ref.seq_lens)
        assert idx.max_lens.int2 >= int(idx.int2_lens.max())
        assert idx.max_lens.int4 >= int(idx.int4_lens.max())
        assert idx.max_lens.full >= int((idx.seq_lens - idx.int4_lens - idx.int2_lens).max())
        for layer in range(L):
            q = torch.randn(H * G, D, generator=g)
            got = decode_attention_ref(
                q[None], st.pool.layers[layer], idx.slot_map[layer][None], idx.seq_lens[layer][None]
            )
            want = dense_attention(st, req, layer, q)
            torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)
        start += 32
        for _ in range(5 + step):  # decode steps between pages
            cells = st.extend(req, [t % 50 + 1])
            fill(st, req, cells)
            idx.append(cells)
            t += 1
    st.finish_request(req, cache=False)


def test_advance_refuses_what_it_cannot_follow_and_leaves_the_index():
    """A window cell still full precision (a partial page; an INT2 page's leftovers), INT4
    and INT2 in one window, full cells before the window: False, the index unchanged (the
    caller rebuilds)."""
    p4 = torch.full((32,), P4, dtype=torch.int8)
    partial = torch.full((L, H, 32), P4, dtype=torch.int8)
    partial[0, 1, 5] = 16  # one column keeps a window cell at full precision
    mixed = torch.full((L, H, 32), P2, dtype=torch.int8)
    mixed[1] = P4  # layer 1 to INT4, layer 0 to INT2 pages
    hole = torch.ones(L, H, 150, dtype=torch.bool)
    hole[1, 0, 70] = False  # that column's 31 cells do not fill an INT2 page: they stay full
    cases = [
        (_advance_setup(), partial, "int4"),
        (_advance_setup(keep=hole), torch.full((32,), P2, dtype=torch.int8), "full"),
        (_advance_setup(), mixed, "int4"),
        (_advance_setup(cut=60), p4, "int4"),  # positions 60-63 stay full, before the window
    ]
    for (st, req), prec, leftover in cases:
        idx = DecodeIndex.build(req.slot_map, st.layout, room=8, device="cpu")
        before = [t.clone() for t in (idx.slot_map, idx.seq_lens, idx.int2_lens, idx.int4_lens)]
        bounds = idx.max_lens
        st.set_precision(req, prec, int2_leftover=leftover, start=64)
        assert not idx.advance(req.slot_map, st.layout, 64, 96)
        after = (idx.slot_map, idx.seq_lens, idx.int2_lens, idx.int4_lens)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        assert idx.max_lens == bounds
        st.finish_request(req, cache=False)
