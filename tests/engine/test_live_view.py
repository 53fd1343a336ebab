"""LayerView: a layer's attended K/V grows in place (a decode step writes its row; the
buffers grow by a quarter when full) and always equals the concatenation it replaces."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agentkv.engine.store_cache import VIEW_GROWTH_MIN, LayerView  # noqa: E402


@pytest.mark.parametrize("masked", [False, True])
def test_appends_equal_concatenation_and_grow_rarely(masked):
    g = torch.Generator().manual_seed(0)
    H, D, n0 = 3, 8, 700
    k0, v0 = torch.randn(n0, H, D, generator=g), torch.randn(n0, H, D, generator=g)
    pos0 = torch.arange(0, 2 * n0, 2)  # (holes: positions need not be consecutive)
    hm0 = torch.rand(H, n0, generator=g) > 0.3 if masked else None
    view = LayerView(k0, v0, pos0, hm0, n0)
    ks, vs, ps, hms = [k0], [v0], [pos0], [hm0]
    buffers, grows = view.k.data_ptr(), 0
    at = 2 * n0
    for m in [1] * 300 + [17, 5, 64] + [1] * 200:  # decode steps, a teacher-forced span
        k, v = torch.randn(m, H, D, generator=g), torch.randn(m, H, D, generator=g)
        p = torch.arange(at, at + m)
        at += m
        view.append(k.double(), v, p)  # (cast to the view's dtype, as the pool's)
        ks.append(k.double().float())
        vs.append(v)
        ps.append(p)
        if masked:
            hms.append(torch.ones(H, m, dtype=torch.bool))
        if view.k.data_ptr() != buffers:
            buffers, grows = view.k.data_ptr(), grows + 1
        k_all, v_all, p_all, hm_all = view.rows()
        assert k_all.dtype == torch.float32 and k_all.shape[0] == view.n
    assert torch.equal(k_all, torch.cat(ks)) and torch.equal(v_all, torch.cat(vs))
    assert torch.equal(p_all, torch.cat(ps))
    if masked:
        assert torch.equal(hm_all, torch.cat(hms, dim=1))
    else:
        assert hm_all is None
    # 587 rows added to 700: the first append grows by max(256, 700 // 4) = 256 rows past
    # its need, then by a quarter: a handful of copies, not one per step
    assert 1 <= grows <= 3
    assert view.k.shape[0] - view.n < max(VIEW_GROWTH_MIN, view.n // 4) + 64


@pytest.mark.parametrize("precision", ["int4", "int2"])
def test_a_view_that_follows_a_page_equals_a_new_view(precision):
    """After a decode-time page (positions re-quantized in place, some evicted per head or
    whole before it), ``follow_page`` re-reads just the page's rows: every layer's view then
    equals, bit for bit, the view a new gather gives."""
    from cache.kv_fill import fill  # (tests/cache: K/V rows that say which token they hold)

    from agentkv.cache import KVStore, Precision
    from agentkv.engine.store_cache import LiveView

    L, H, D = 2, 2, 32
    g = torch.Generator().manual_seed(1)
    st = KVStore(L, H, D, num_slots=1024)

    req = st.begin_request(None, [i % 50 + 1 for i in range(200)])
    fill(st, req, st.extend(req))
    keep = torch.rand(L, H, 200, generator=g) > 0.2
    keep[:, :, 7] = False  # a position no head keeps: not in the view
    st.evict_per_head(req, keep)
    view = LiveView(st, req)
    with torch.inference_mode():  # (as in the engine's forward passes)
        for layer in range(L):  # (the views of the layers a forward has touched)
            view._base(layer, 200)
    for step in range(40):  # decode steps appended to the view
        cells = st.extend(req, [5])
        fill(st, req, cells)
        with torch.inference_mode():
            for layer in range(L):
                k, v = st.pool.gather(layer, st.layer_cells(cells, layer))
                view.extend(layer, k, v, torch.tensor([200 + step]), 200 + step)
    p = int(Precision.INT4 if precision == "int4" else Precision.INT2)
    start, end = 64, 160  # (INT2: three whole pages where no head lost a cell, else left full)
    st.set_precision(req, torch.full((end - start,), p, dtype=torch.int8), start=start,
                     int2_leftover="full")  # fmt: skip
    assert view.follow_page(start, end) is view
    fresh = LiveView(st, req)
    for layer in range(L):
        fresh._base(layer, 240)
        got, want = view._layers[layer].rows(), fresh._layers[layer].rows()
        for a, b in zip(got, want, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
    st.finish_request(req, cache=False)


@pytest.mark.parametrize("first_mask", ["none", "some"])
def test_a_view_that_follows_an_eviction_attends_as_a_new_view(first_mask):
    """A decode-time pruning pass evicts cells of a window of positions (KVzap: those that
    left its recent window): ``follow_eviction`` drops the rows no head keeps any more and
    sets the others' head masks, without re-gathering the view; every layer's rows then equal
    a new view's, bit for bit (a mask that keeps every key counting as none), and so do the
    rows the next decode steps append. ``first_mask``: the view had a head mask before, or
    not."""
    from cache.kv_fill import fill

    from agentkv.cache import KVStore
    from agentkv.engine.store_cache import LiveView

    L, H, D = 2, 2, 32
    g = torch.Generator().manual_seed(2)
    st = KVStore(L, H, D, num_slots=1024)
    req = st.begin_request(None, [i % 50 + 1 for i in range(200)])
    fill(st, req, st.extend(req))
    if first_mask == "some":
        keep = torch.ones(L, H, 200, dtype=torch.bool)
        keep[1, 0, 3:9] = False
        st.evict_per_head(req, keep)
    view = LiveView(st, req)

    def decode(n: int) -> None:
        for _ in range(n):
            pos = req.seq_len
            cells = st.extend(req, [5])
            fill(st, req, cells)
            with torch.inference_mode():
                for layer in range(L):
                    k, v = st.pool.gather(layer, st.layer_cells(cells, layer))
                    view.extend(layer, k, v, torch.tensor([pos]), pos)

    def same_as_a_new_view() -> None:
        fresh = LiveView(st, req)
        for layer in range(L):
            with torch.inference_mode():
                fresh._base(layer, req.seq_len)
            got, want = view._layers[layer].rows(), fresh._layers[layer].rows()
            for a, b in zip(got[:3], want[:3], strict=True):
                assert torch.equal(a, b)
            ones = torch.ones(H, got[2].numel(), dtype=torch.bool)
            hg = ones if got[3] is None else got[3]
            hw = ones if want[3] is None else want[3]
            assert torch.equal(hg, hw)

    with torch.inference_mode():
        for layer in range(L):
            view._base(layer, 200)
    decode(24)
    keep = torch.rand(L, H, 16, generator=g) > 0.5  # positions 150 .. 165
    keep[:, :, 4] = False  # position 154: no head keeps it
    keep[:, :, 5] = True  # position 155: every head does
    st.evict_per_head(req, keep, start=150)
    assert view.follow_eviction(150, 166) is view
    same_as_a_new_view()
    decode(8)
    same_as_a_new_view()
    st.evict(req, torch.arange(166, 182))  # (every head: the rows leave)
    view.follow_eviction(166, 182)
    same_as_a_new_view()
    st.finish_request(req, cache=False)
