import pytest
import torch

from agentkv.cache import DEAD, SlotMap

L, H = 2, 2
C = L * H
FULL_LIMIT = 100  # ids >= 100 are quantized cells in these tests


def cells(n, first=1):
    """[C, n] distinct cells: column c holds first + 10 * c + i."""
    return first + torch.arange(n)[None, :] + 10 * torch.arange(C)[:, None]


def make(n=6):
    m = SlotMap(L, H, full_limit=FULL_LIMIT)
    m.append(cells(n))
    return m


def test_append_grows_and_keeps_order():
    m = SlotMap(1, 1)
    for i in range(40):
        m.append(torch.tensor([[i + 1]]))
    assert m.slots.tolist() == [list(range(1, 41))]
    assert len(m) == 40 and m.num_resident == 40 and m.num_dead == 0
    assert bool(m.keep_mask.all()) and m.keep_mask.shape == (1, 1, 40)
    with pytest.raises(ValueError, match="real cells"):
        m.append(torch.tensor([[DEAD]]))
    with pytest.raises(ValueError, match="cells must be"):
        m.append(torch.tensor([1, 2]))


def test_layer_slots_are_views_of_the_columns():
    m = make(3)
    assert torch.equal(m.layer_slots(1), m.slots[H : 2 * H])
    assert m.layer_slots(1).shape == (H, 3)


def test_evict_redirects_every_column_and_returns_released_cells_once():
    m = make()
    rel = m.evict([4, 1, 1])
    assert rel.shape == (C, 2)
    assert torch.equal(rel, cells(6)[:, [1, 4]])
    assert bool((m.slots[:, [1, 4]] == DEAD).all())
    assert bool((m.evict([1]) == DEAD).all())  # already dead: nothing released twice
    assert m.num_dead == 2 and m.live_entries() == 4 * C
    with pytest.raises(IndexError):
        m.evict([6])


def test_evict_cells_is_per_column_and_a_position_dies_only_when_every_column_is_gone():
    m = make(4)
    before = m.slots.clone()
    keep = torch.ones(L, H, 4, dtype=torch.bool)
    keep[0, 0, 1] = False  # one head of one layer
    keep[:, :, 2] = False  # everything of position 2
    rel = m.evict_cells(keep)
    assert rel.shape == (C, 4)
    assert int(rel[0, 1]) == int(before[0, 1]) and bool((rel[1:, 1] == DEAD).all())
    assert torch.equal(rel[:, 2], before[:, 2])
    assert int((rel != DEAD).sum()) == 1 + C
    assert m.num_dead == 1 and m.num_resident == 3
    assert m.live_entries() == 4 * C - 1 - C
    assert m.effective_live_tokens() == pytest.approx((4 * C - 1 - C) / C)
    assert m.keep_mask[0, 0].tolist() == [True, False, False, True]
    # a dead cell stays dead: keeping it does not revive it, evicting it releases nothing
    rel = m.evict_cells(torch.ones(L, H, 4, dtype=torch.bool))
    assert bool((rel == DEAD).all()) and not bool(m.keep_mask[0, 0, 1])
    # a plan may cover a prefix (T' < T): later positions are untouched; [C, T'] works too
    keep = torch.ones(C, 2, dtype=torch.bool)
    keep[:, 1] = False
    assert int((m.evict_cells(keep) != DEAD).sum()) == C - 1
    assert m.slots[:, 3].ne(DEAD).all()
    with pytest.raises(ValueError):
        m.evict_cells(torch.ones(L, H, 5, dtype=torch.bool))
    with pytest.raises(ValueError):
        m.evict_cells(torch.ones(L + 1, H, 2, dtype=torch.bool))


def test_intact_prefix_counts_full_precision_live_cells_in_every_column():
    m = make(5)
    assert m.intact_prefix_len() == 5
    keep = torch.ones(L, H, 5, dtype=torch.bool)
    keep[1, 0, 3] = False  # position 3 gone in one column only
    m.evict_cells(keep)
    assert m.intact_prefix_len() == 3
    # a quantized cell (id >= full_limit) also breaks the intact run
    old = m.replace(torch.tensor([2]), torch.tensor([1]), torch.tensor([FULL_LIMIT + 7]))
    assert old.tolist() == [int(cells(5)[2, 1])]
    assert m.intact_prefix_len() == 1
    assert m.full_precision()[:, 1].tolist() == [True, True, False, True]
    assert m.keep_mask[1, 0, 1]  # quantized cells are live
    m.evict([0])
    assert m.intact_prefix_len() == 0
    m.append(cells(1, first=50))
    assert bool(m.keep_mask[:, :, 5].all())
    # without full_limit every live cell counts as full precision
    m2 = SlotMap(L, H, m.slots)
    assert bool(m2.full_precision()[:, 1].all())


def test_replace_moves_only_live_cells():
    m = make(3)
    m.evict([2])
    with pytest.raises(ValueError, match="live cells"):
        m.replace(torch.tensor([0]), torch.tensor([2]), torch.tensor([FULL_LIMIT]))
    cols, pos = torch.tensor([0, 3]), torch.tensor([0, 1])
    new = torch.tensor([FULL_LIMIT + 1, FULL_LIMIT + 2])
    old = m.replace(cols, pos, new)
    assert old.tolist() == [int(cells(3)[0, 0]), int(cells(3)[3, 1])]
    assert m.slots[cols, pos].tolist() == new.tolist()


def test_initial_map_with_holes_and_clone():
    init = cells(3)
    init[:, 1] = DEAD
    init[0, 2] = DEAD
    m = SlotMap(L, H, init, full_limit=FULL_LIMIT)
    assert m.num_resident == 2 and m.num_dead == 1 and m.live_entries() == 2 * C - 1
    assert m.resident().tolist() == [True, False, True]
    c = m.clone()
    c.evict([0])
    assert m.num_resident == 2 and c.num_resident == 1  # independent copies
    with pytest.raises(ValueError, match="slots must be"):
        SlotMap(L, H, torch.tensor([4, DEAD, 5]))
