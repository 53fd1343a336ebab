import pytest
import torch

from agentkv.cache import DEAD, SlotMap


def make(n=6, L=2, H=2):
    m = SlotMap(L, H)
    m.append(torch.arange(1, n + 1))
    return m


def test_append_grows_and_keeps_order():
    m = SlotMap(1, 1)
    for i in range(40):
        m.append(torch.tensor([i + 1]))
    assert m.slots.tolist() == list(range(1, 41))
    assert m.keep_mask is None and m.num_resident == 40


def test_evict_redirects_to_dead_and_returns_released_slots_once():
    m = make()
    rel = m.evict([4, 1, 1])
    assert sorted(rel.tolist()) == [2, 5]
    assert m.slots.tolist() == [1, DEAD, 3, 4, DEAD, 6]
    assert m.evict([1]).numel() == 0  # already dead: no second release
    assert m.num_dead == 2 and m.live_entries() == 4 * 2 * 2
    with pytest.raises(IndexError):
        m.evict([6])


def test_evict_heads_kills_a_position_only_when_every_layer_and_head_is_gone():
    m = make(4)
    keep = torch.ones(2, 2, 4, dtype=torch.bool)
    keep[0, 0, 1] = False  # one head of one layer
    keep[:, :, 2] = False  # everything of position 2
    rel = m.evict_heads(keep)
    assert rel.tolist() == [3]
    assert m.slots.tolist() == [1, 2, DEAD, 4]
    assert m.live_entries() == 4 * 4 - 1 - 4
    assert m.effective_live_tokens() == pytest.approx(11 / 4)
    # the mask only ever loses bits
    rel = m.evict_heads(torch.ones(2, 2, 4, dtype=torch.bool))
    assert rel.numel() == 0 and not bool(m.keep_mask[0, 0, 1])
    # the rest of position 1
    keep = torch.ones(2, 2, 2, dtype=torch.bool)  # T' < T: positions 2.. untouched
    keep[:, :, 1] = False
    assert m.evict_heads(keep).tolist() == [2]
    assert m.slots.tolist() == [1, DEAD, DEAD, 4]


def test_layer_live_and_intact_prefix():
    m = make(5)
    assert m.intact_prefix_len() == 5
    keep = torch.ones(2, 2, 5, dtype=torch.bool)
    keep[1, :, 3] = False  # position 3 gone in layer 1 only
    m.evict_heads(keep)
    assert m.intact_prefix_len() == 3
    assert m.layer_live(0).tolist() == [True] * 5
    assert m.layer_live(1).tolist() == [True, True, True, False, True]
    m.evict([1])
    assert m.intact_prefix_len() == 1
    m.append(torch.tensor([9]))  # new positions are live everywhere
    assert bool(m.keep_mask[:, :, 5].all())


def test_initial_map_with_holes_and_mask_is_checked():
    mask = torch.ones(1, 2, 3, dtype=torch.bool)
    mask[:, :, 1] = False
    m = SlotMap(1, 2, torch.tensor([4, DEAD, 5]), mask)
    assert m.slots.tolist() == [4, DEAD, 5] and m.num_resident == 2
    with pytest.raises(ValueError, match="must map to DEAD"):
        SlotMap(1, 2, torch.tensor([4, 7, 5]), mask)
    m2 = SlotMap(1, 2, torch.tensor([4, DEAD, 5]))  # no mask: DEAD means dead everywhere
    assert m2.live_entries() == 4 and m2.held_slots().tolist() == [4, 5]
