"""Hole- and precision-preserving prefix reuse across an agent's turns."""

import torch

from agentkv.cache import DEAD, KVStore, Precision

from .kv_fill import check_content, fill

L, H, D = 2, 2, 32
C = L * H
SYSTEM = [100, 101, 102, 103, 104, 105]


def turn(st, session, prompt, response):
    req = st.begin_request(session, prompt)
    fill(st, req, st.extend(req))
    for t in response:
        fill(st, req, st.extend(req, [t]))
    return req


def dead_positions(req):
    """Positions with no live cell in any column."""
    return torch.nonzero(~req.slot_map.resident()).reshape(-1).tolist()


def drained(st, sessions):
    for s in sessions:
        st.end_session(s)
    st.flush_prefix_cache()
    st.check_invariants()
    s = st.stats()
    assert s.free_slots == s.capacity and s.used_bytes == 0


def test_same_session_replays_holes_and_precision_other_session_gets_original_cells():
    st = KVStore(L, H, D, num_slots=128)
    # Session B caches the plain system prompt first.
    b1 = turn(st, "B", SYSTEM + [7], [8])
    st.finish_request(b1)
    original = st.prefix_cache.match(None, torch.tensor(SYSTEM)).slots.clone()

    # Session A, turn 1: reuses the system prompt, then evicts and quantizes inside it and
    # after it.
    prompt1 = SYSTEM + [1, 2, 3, 4]
    a1 = turn(st, "A", prompt1, [20, 21])
    assert a1.num_cached == len(SYSTEM) and not a1.prefix_from_session
    st.evict(a1, [2, 7])  # position 2 is in the shared system prompt, 7 is A's own
    keep = torch.ones(L, H, a1.seq_len, dtype=torch.bool)
    keep[0, 1, 8] = False  # one head of one layer of position 8
    keep[:, :, 9] = False  # position 9 everywhere
    st.evict_per_head(a1, keep)
    prec = torch.full((L, H, 6), int(Precision.FULL), dtype=torch.int8)
    prec[1, :, 3:6] = int(Precision.INT4)  # layer 1 quantizes positions 3..5
    st.set_precision(a1, prec)
    assert dead_positions(a1) == [2, 7, 9]
    seq1 = list(a1.token_ids)
    slots1 = a1.slot_map.slots.clone()
    st.finish_request(a1)
    st.check_invariants()

    # Session A, turn 2 = turn-1 prompt + response + a new message.
    prompt2 = seq1 + [30, 31]
    a2 = st.begin_request("A", prompt2)
    assert a2.prefix_from_session and a2.num_cached == len(seq1)
    assert a2.num_pending == 2  # only the new tokens are prefilled
    assert torch.equal(a2.slot_map.slots[:, : len(seq1)], slots1)  # same cells and holes
    fill(st, a2, st.extend(a2))
    check_content(st, a2)
    _, _, pos, hm = st.read_kv(a2, 0)
    assert not set(pos.tolist()) & {2, 7, 9}
    assert hm is not None and not bool(hm[1, pos.tolist().index(8)])
    pr = st.layout.precision(a2.slot_map.layer_slots(1))
    assert bool((pr[:, 3:6] == int(Precision.INT4)).all())  # quantized cells reused as is

    # Session C shares only the system prompt: it gets the original full-precision cells.
    c1 = st.begin_request("C", SYSTEM + [40])
    assert c1.num_cached == len(SYSTEM) and not c1.prefix_from_session
    assert torch.equal(c1.slot_map.slots, original) and bool(c1.slot_map.keep_mask.all())
    fill(st, c1, st.extend(c1))
    check_content(st, c1)  # original K/V of positions 2..5 is still there, bit for bit

    # Turn 2 evicts more; turn 3 sees both turns' holes.
    st.evict(a2, [len(seq1)])
    seq2 = list(a2.token_ids)
    st.finish_request(a2)
    a3 = st.begin_request("A", seq2 + [50])
    assert a3.num_cached == len(seq2)
    assert dead_positions(a3) == [2, 7, 9, len(seq1)]
    st.finish_request(a3)

    # Ending A keeps the system prompt for everyone else.
    st.end_session("A")
    c2 = st.begin_request("C", SYSTEM + [40, 41])
    assert torch.equal(c2.slot_map.slots[:, : len(SYSTEM)], original)
    st.check_invariants()
    for r in (c1, c2):
        st.finish_request(r)
    drained(st, ["A", "B", "C"])


def test_session_eviction_does_not_free_cells_other_sessions_share():
    st = KVStore(L, H, D, num_slots=64)
    st.finish_request(turn(st, "A", SYSTEM + [1], []))
    b = turn(st, "B", SYSTEM + [2], [])
    free_before = st.allocator.free_cells(Precision.FULL)
    a = turn(st, "A", SYSTEM + [1, 3], [])
    st.evict(a, list(range(len(SYSTEM))))  # A evicts the whole shared prompt
    # only A's new token is held in each column; nothing was freed
    assert (free_before - st.allocator.free_cells(Precision.FULL)).tolist() == [1] * C
    st.finish_request(a)
    st.prefix_cache.evict(10_000)  # LRU pressure: B's locked path survives
    check_content(st, b)
    st.finish_request(b)
    b2 = st.begin_request("B", SYSTEM + [2, 5])
    assert b2.num_cached == len(SYSTEM) + 1 and b2.slot_map.num_dead == 0
    fill(st, b2, st.extend(b2))
    check_content(st, b2)
    st.finish_request(b2, cache=False)
    st.check_invariants()
    drained(st, ["A", "B"])


def test_session_holes_win_over_a_longer_unevicted_shared_copy():
    """Another session caching the same conversation unevicted must not heal A's holes."""
    st = KVStore(L, H, D, num_slots=256)
    prompt1 = SYSTEM + [1, 2, 3, 4]
    a1 = turn(st, "A", prompt1, [20, 21])
    st.evict(a1, [7])
    seq1 = list(a1.token_ids)
    st.finish_request(a1)
    # Session B replays the same conversation further, with no eviction: the shared
    # namespace now matches A's next prompt longer than A's own namespace does.
    prompt2 = seq1 + [30, 31]
    b = turn(st, "B", prompt2 + [32], [33])
    st.finish_request(b)
    assert st.prefix_cache.match(None, torch.tensor(prompt2)).length > len(seq1)
    a2 = st.begin_request("A", prompt2)
    assert a2.prefix_from_session and a2.num_cached == len(seq1)
    assert bool((a2.slot_map.slots[:, 7] == DEAD).all())
    fill(st, a2, st.extend(a2))
    st.finish_request(a2)
    st.check_invariants()
    drained(st, ["A", "B"])


def test_session_quantization_wins_over_a_longer_full_precision_shared_copy():
    """A's INT4 cells are A's decision: a full-precision shared copy must not undo it."""
    st = KVStore(L, H, D, num_slots=256)
    a1 = turn(st, "A", SYSTEM + [1, 2], [3])
    st.set_precision(a1, torch.full((4,), int(Precision.INT4), dtype=torch.int8))
    seq1 = list(a1.token_ids)
    st.finish_request(a1)
    b = turn(st, "B", seq1 + [5, 6, 7], [])
    st.finish_request(b)
    a2 = st.begin_request("A", seq1 + [5, 6, 7])
    assert a2.prefix_from_session and a2.num_cached == len(seq1)
    pr = st.layout.precision(a2.slot_map.slots)
    assert bool((pr[:, :4] == int(Precision.INT4)).all())
    fill(st, a2, st.extend(a2))
    check_content(st, a2)
    st.finish_request(a2)
    drained(st, ["A", "B"])
