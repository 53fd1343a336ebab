import pytest
import torch

from agentkv.cache import DEAD, KVPool


def test_buffers_shapes_and_bytes():
    pool = KVPool(3, 10, 2, 4, dtype=torch.bfloat16)
    assert len(pool.k_buffer) == 3 and len(pool.v_buffer) == 3
    assert pool.get_key_buffer(0).shape == (10, 2, 4)
    assert pool.get_value_buffer(2).dtype == torch.bfloat16
    assert pool.bytes_per_token == 2 * 3 * 2 * 4 * 2
    assert pool.total_bytes == 10 * pool.bytes_per_token


def test_write_gather_roundtrip_per_layer():
    pool = KVPool(2, 8, 2, 3)
    slots = torch.tensor([5, 2, 7])
    k = torch.randn(3, 2, 3)
    v = torch.randn(3, 2, 3)
    pool.set_kv_buffer(1, slots, k, v)
    gk, gv = pool.gather(1, torch.tensor([7, 5]))
    assert torch.equal(gk, k[[2, 0]]) and torch.equal(gv, v[[2, 0]])
    assert torch.count_nonzero(pool.get_key_buffer(0)) == 0  # other layer untouched


def test_write_rejects_dead_slot_and_bad_shapes():
    pool = KVPool(1, 4, 1, 2)
    with pytest.raises(ValueError, match="dead slot"):
        pool.write(0, torch.tensor([DEAD]), torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    with pytest.raises(ValueError, match="must be"):
        pool.write(0, torch.tensor([1]), torch.ones(1, 2, 2), torch.ones(1, 1, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pool_on_cuda():
    pool = KVPool(1, 4, 1, 2, dtype=torch.float16, device="cuda")
    pool.write(0, torch.tensor([3]), torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    k, _ = pool.gather(0, torch.tensor([3]))
    assert k.device.type == "cuda" and float(k.sum()) == 2.0
