"""DEAD dropped from SGLang's attention metadata: the compaction, then SGLang's own Triton
index builder and decode kernel (TRITON_INTERPRET=1 on CPU) over holey rows."""

from __future__ import annotations

import os
import random

import pytest
import torch

from agentkv.integrations.sglang.attention import drop_dead_kv_indices, make_backend_class

DEAD = 999


def test_compaction_keeps_order_and_rewrites_indptr():
    g = random.Random(0)
    lens = [5, 0, 9, 3, 12]
    rows = [[DEAD if g.random() < 0.4 else g.randrange(1, 900) for _ in range(n)] for n in lens]
    flat = [s for r in rows for s in r]
    for dtype in (torch.int32, torch.int64):
        indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=dtype)
        indices = torch.tensor(flat + [DEAD, 7, 7], dtype=torch.int64)  # over-allocated tail
        drop_dead_kv_indices(indptr, indices, DEAD)
        total = int(indptr[-1])
        want = [[s for s in r if s != DEAD] for r in rows]
        assert total == sum(map(len, want))
        assert indptr.dtype == dtype
        assert indptr.tolist() == [0, *torch.tensor([len(w) for w in want]).cumsum(0).tolist()]
        got = [indices[indptr[i] : indptr[i + 1]].tolist() for i in range(len(lens))]
        assert got == want
        assert indices[len(flat) :].tolist() == [DEAD, 7, 7]  # past the batch: untouched


def test_compaction_reads_nothing_back_to_the_host(host_reads):
    """Run per attention-metadata build under the overlap scheduler: no device-to-host read
    (the batch's length is compared on the device)."""
    indptr = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    indices = torch.tensor([1, DEAD, 2, 3, DEAD, DEAD, 4, DEAD, 9], dtype=torch.int64)
    with host_reads:
        drop_dead_kv_indices(indptr, indices, DEAD)
    assert host_reads.count == 0, host_reads.ops
    assert indptr.tolist() == [0, 2, 2, 4]
    assert indices[:4].tolist() == [1, 2, 3, 4] and indices[-2:].tolist() == [DEAD, 9]


def test_backend_is_sglangs_triton_backend_with_the_override():
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    cls = make_backend_class()
    assert issubclass(cls, TritonAttnBackend)
    assert "_fill_kv_indptr_and_indices" in cls.__dict__ and "forward_extend" in cls.__dict__


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_sglang_decode_kernel_never_reads_dead():
    """Two requests with holes: SGLang's index builder + the compaction + SGLang's decode
    kernel equal attention over the live positions only; the same kernel on the uncompacted
    indices does not (the DEAD row holds values that would be read)."""
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang.kernels.ops.kvcache.kv_indices import create_flashinfer_kv_indices_triton
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    torch.manual_seed(0)
    hq, hkv, d, size, dead = 4, 2, 16, 64, 64
    kv = MHATokenToKVPool(
        size=size,
        page_size=1,
        dtype=torch.float32,
        head_num=hkv,
        head_dim=d,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    k_buf, v_buf = kv.get_key_buffer(0), kv.get_value_buffer(0)
    k_buf.copy_(torch.randn_like(k_buf))
    v_buf.copy_(torch.randn_like(v_buf))
    k_buf[dead] = 5.0  # a DEAD row that would dominate the softmax if read
    v_buf[dead] = 100.0
    r2t = ReqToTokenPool(size=4, max_context_len=32, device="cpu", enable_memory_saver=False)
    seqs = {1: list(range(1, 21)), 2: list(range(30, 42))}
    holes = {1: [3, 4, 5, 10, 19], 2: [0, 7]}
    for row, slots in seqs.items():
        s = torch.tensor(slots, dtype=torch.int32)
        s[holes[row]] = dead
        r2t.req_to_token[row, : len(slots)] = s
    bs = 2
    req_pool_indices = torch.tensor([1, 2], dtype=torch.int64)
    seq_lens = torch.tensor([len(seqs[1]), len(seqs[2])], dtype=torch.int64)
    q = torch.randn(bs, hq, d)
    sm_scale = d**-0.5

    def run(compact: bool) -> torch.Tensor:
        kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(seq_lens, 0)
        kv_indices = torch.empty(int(seq_lens.sum()), dtype=torch.int64)
        create_flashinfer_kv_indices_triton[(bs,)](
            r2t.req_to_token,
            req_pool_indices,
            seq_lens,
            kv_indptr,
            None,
            kv_indices,
            r2t.req_to_token.stride(0),
        )
        if compact:
            drop_dead_kv_indices(kv_indptr, kv_indices, dead)
        splits = 4
        o = torch.empty(bs, hq, d)
        decode_attention_fwd(
            q,
            k_buf,
            v_buf,
            o,
            kv_indptr,
            kv_indices,
            torch.empty(bs, hq, splits, d),
            torch.empty(bs, hq, splits),
            torch.full((bs,), splits, dtype=torch.int32),
            splits,
            sm_scale,
            1.0,
            1.0,
        )
        return o

    want = torch.empty(bs, hq, d)
    for b, row in enumerate((1, 2)):
        live = [s for i, s in enumerate(seqs[row]) if i not in holes[row]]
        k = k_buf[live].repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = v_buf[live].repeat_interleave(hq // hkv, dim=1)
        att = torch.softmax(torch.einsum("hd,nhd->hn", q[b], k) * sm_scale, dim=-1)
        want[b] = torch.einsum("hn,nhd->hd", att, v)
    torch.testing.assert_close(run(compact=True), want, atol=2e-5, rtol=2e-5)
    assert (run(compact=False) - want).abs().max() > 1.0
