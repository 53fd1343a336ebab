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
