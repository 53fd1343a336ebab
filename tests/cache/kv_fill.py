"""Deterministic K/V content for store tests.

Each (token, position, layer, KV head) has its own pseudo-random K and V rows (a hash of the
four numbers and the channel, values in [-2, 2)), so reading a cell back proves which token
it holds: a cell reused while something still referenced it, a K/V swap, a head mix-up or a
cell moved to another position all read back wrong. Full-precision cells must read back bit
for bit; quantized cells within the quantization error of their precision.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from agentkv.cache import DEAD, KVStore, Precision, RequestKV

AMPLITUDE = 2.0
# Max |read - written| per precision for values in [-A, A): asymmetric min/max quantization
# errs by at most half a step (range / qmax / 2; range <= 2A), plus fp16 rounding of the
# scale and zero. Two different rows differ by far more than 2 * tol in some channel.
TOLERANCE = {
    Precision.FULL: 0.0,
    Precision.INT4: 2 * AMPLITUDE / 15 / 2 + 0.02,
    Precision.INT2: 2 * AMPLITUDE / 3 / 2 + 0.03,
}


def _hash(x: torch.Tensor) -> torch.Tensor:
    """float64 -> [0, 1) pseudo-random (the classic sin-fract hash, exact in float64)."""
    y = torch.sin(x) * 43758.5453123
    return y - torch.floor(y)


def kv_value(
    tokens: torch.Tensor, positions: torch.Tensor, layer: int, H: int, D: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V rows ``[n, H, D]`` float32 of ``tokens`` (int64 ``[n]``) at ``positions``."""
    t = tokens.double().view(-1, 1, 1)
    p = positions.double().view(-1, 1, 1)
    h = torch.arange(H, dtype=torch.float64).view(1, -1, 1)
    c = torch.arange(D, dtype=torch.float64).view(1, 1, -1)
    base = t * 12.9898 + p * 78.233 + layer * 37.719 + h * 4.581 + c * 0.1731
    k = (_hash(base) * 2 - 1) * AMPLITUDE
    v = (_hash(base + 1000.5) * 2 - 1) * AMPLITUDE
    return k.float(), v.float()


@lru_cache(maxsize=1024)
def _sequence_kv(
    tokens: tuple[int, ...], start: int, layer: int, H: int, D: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kv_value` of a whole run of tokens from position ``start`` (memoized: the
    invariant checks reread the same sequences at every step). Do not modify the result."""
    toks = torch.tensor(tokens, dtype=torch.int64)
    return kv_value(toks, torch.arange(start, start + len(tokens)), layer, H, D)


def fill(store: KVStore, req: RequestKV, cells: torch.Tensor) -> None:
    """Write K/V of the positions ``cells`` (``[L * Hkv, n]``, from ``extend``) were just
    allocated for: the last ``n`` positions of ``req``."""
    n = int(cells.shape[1])
    pos = torch.arange(req.seq_len - n, req.seq_len)
    toks = torch.tensor(req.token_ids[req.seq_len - n : req.seq_len], dtype=torch.int64)
    H, D = store.pool.num_kv_heads, store.pool.head_dim
    for layer in range(store.num_layers):
        k, v = kv_value(toks, pos, layer, H, D)
        store.write_kv(layer, store.layer_cells(cells, layer), k, v)


def check_content(store: KVStore, req: RequestKV) -> None:
    """Every layer of ``req`` reads the K/V of its own tokens at their positions: bit for bit
    from full cells, within :data:`TOLERANCE` from quantized ones, zeros from dead ones; and
    ``head_mask`` / ``positions`` agree with the slot map."""
    H, D = store.pool.num_kv_heads, store.pool.head_dim
    toks = tuple(req.token_ids[: req.seq_len])
    for layer in range(store.num_layers):
        cells = req.slot_map.layer_slots(layer)  # [H, T]
        k, v, pos, head_mask = store.read_kv(req, layer)
        live = cells != DEAD
        assert pos.tolist() == torch.nonzero(live.any(dim=0)).reshape(-1).tolist()
        want_mask = live[:, pos]
        if head_mask is None:
            assert bool(want_mask.all())
        else:
            assert torch.equal(head_mask, want_mask)
        ak, av = _sequence_kv(toks, 0, layer, H, D)
        wk, wv = ak[pos], av[pos]
        prec = store.layout.precision(cells[:, pos]).t()  # [n, H]
        for p, tol in TOLERANCE.items():
            sel = prec == int(p)
            for got, want, name in ((k, wk, "K"), (v, wv, "V")):
                err = (got[sel] - want[sel]).abs()
                if err.numel():
                    assert float(err.max()) <= tol, (
                        f"layer {layer}: {name} of {p.label} cells off by {float(err.max())}"
                    )
        dead = prec == int(Precision.EVICTED)
        assert bool((k[dead] == 0).all()) and bool((v[dead] == 0).all())


def check_cached(store: KVStore) -> None:
    """Every prefix-cache node reads back the K/V of its own tokens (same rules as
    :func:`check_content`); shared-namespace nodes hold only full cells, so bit for bit."""
    H, D = store.pool.num_kv_heads, store.pool.head_dim
    for sid, start, node in store.prefix_cache.iter_nodes():
        for layer in range(store.num_layers):
            cells = store.layer_cells(node.value, layer)  # [H, n]
            k, v = store.pool.gather(layer, cells)
            wk, wv = _sequence_kv(tuple(node.key.tolist()), start, layer, H, D)
            prec = store.layout.precision(cells).t()
            if sid is None:
                assert bool((prec == int(Precision.FULL)).all())
            for p, tol in TOLERANCE.items():
                sel = prec == int(p)
                for got, want in ((k, wk), (v, wv)):
                    err = (got[sel] - want[sel]).abs()
                    if err.numel():
                        assert float(err.max()) <= tol, (sid, start, p.label, float(err.max()))
