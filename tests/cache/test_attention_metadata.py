import torch

from agentkv.cache import DEAD, KVPool, SlotMap, build_batch_kv_indices, build_layer_kv_index


def test_dead_entries_are_dropped_and_positions_kept():
    m = SlotMap(2, 2)
    m.append(torch.tensor([3, 8, 5, 6]))
    m.evict([1])
    idx = build_layer_kv_index(m, 0)
    assert idx.slots.tolist() == [3, 5, 6]
    assert idx.positions.tolist() == [0, 2, 3]
    assert idx.head_mask is None
    assert DEAD not in idx.slots.tolist()


def test_per_layer_and_per_head_eviction():
    m = SlotMap(2, 2)
    m.append(torch.tensor([3, 8, 5]))
    keep = torch.ones(2, 2, 3, dtype=torch.bool)
    keep[0, :, 0] = False  # position 0 gone in layer 0 only
    keep[1, 1, 2] = False  # position 2 gone in head 1 of layer 1
    m.evict_heads(keep)
    l0 = build_layer_kv_index(m, 0)
    assert l0.positions.tolist() == [1, 2] and l0.head_mask is None
    l1 = build_layer_kv_index(m, 1)
    assert l1.positions.tolist() == [0, 1, 2]
    assert l1.head_mask.tolist() == [[True, True, True], [True, True, False]]


def test_batch_csr_indices():
    a, b = SlotMap(1, 1), SlotMap(1, 1)
    a.append(torch.tensor([1, 2, 3]))
    b.append(torch.tensor([4, 5]))
    a.evict([1])
    out = build_batch_kv_indices([a, b])
    assert out.kv_indptr.tolist() == [0, 2, 4]
    assert out.kv_indices.tolist() == [1, 3, 4, 5]
    assert out.kv_positions.tolist() == [0, 2, 0, 1]


def _attend(q, k, v, mask):
    """q [Hkv, D], k/v [Hkv, n, D], mask [Hkv, n] -> [Hkv, D]."""
    s = torch.einsum("hd,hnd->hn", q, k).masked_fill(~mask, float("-inf"))
    return torch.einsum("hn,hnd->hd", s.softmax(-1), v)


def test_gathered_attention_equals_masked_full_attention():
    torch.manual_seed(0)
    L, H, D, T = 2, 2, 8, 10
    pool = KVPool(L, 32, H, D)
    m = SlotMap(L, H)
    slots = torch.randperm(31)[:T] + 1
    m.append(slots)
    k_full, v_full = torch.randn(L, T, H, D), torch.randn(L, T, H, D)
    for layer in range(L):
        pool.write(layer, slots, k_full[layer], v_full[layer])
    keep = torch.rand(L, H, T) > 0.4
    keep[:, :, 0] = True
    m.evict_heads(keep)
    m.evict([3])
    keep[:, :, 3] = False
    q = torch.randn(H, D)
    for layer in range(L):
        idx = build_layer_kv_index(m, layer)
        k, v = pool.gather(layer, idx.slots)
        hm = (
            idx.head_mask
            if idx.head_mask is not None
            else torch.ones(H, len(idx.slots), dtype=torch.bool)
        )
        got = _attend(q, k.transpose(0, 1), v.transpose(0, 1), hm)
        want = _attend(q, k_full[layer].transpose(0, 1), v_full[layer].transpose(0, 1), keep[layer])
        torch.testing.assert_close(got, want)
