"""Random mixed-precision decode batches (INT2 | INT4 | full segments, DEAD positions,
head masks) for the kernel tests. Imported by conftest.py and the test modules; the Triton
interpreter switch is set in conftest.py before this module (and agentkv.kernels) loads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentkv.kernels import Int4Pool, KVPools, decode_attention, write_int2_pages, write_int4

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class MixedBatch:
    """A decode batch over three pools.

    slot_map [B, L] int32, seq_lens / int2_lens / int4_lens [B] int32, q [B, Hq, D],
    head_mask [B, Hkv, L] bool or None.
    """

    pools: KVPools
    q: torch.Tensor
    slot_map: torch.Tensor
    seq_lens: torch.Tensor
    int2_lens: torch.Tensor
    int4_lens: torch.Tensor
    head_mask: torch.Tensor | None

    def decode(self, **kw) -> torch.Tensor:
        """The Triton ``decode_attention`` of the batch (``kw``: its keyword arguments)."""
        return decode_attention(
            self.q,
            self.pools,
            self.slot_map,
            self.seq_lens,
            int2_lens=self.int2_lens,
            int4_lens=self.int4_lens,
            head_mask=self.head_mask,
            backend="triton",
            **kw,
        )


def _dead_mask(n: int, fraction: float, pattern: str, gen: torch.Generator) -> torch.Tensor:
    """[n] bool, True = DEAD. pattern: 'random' positions or one contiguous 'run'."""
    if fraction <= 0 or n == 0:
        return torch.zeros(n, dtype=torch.bool)
    if pattern == "random":
        return torch.rand(n, generator=gen) < fraction
    run = int(round(n * fraction))
    start = int(torch.randint(0, max(1, n - run + 1), (1,), generator=gen))
    m = torch.zeros(n, dtype=torch.bool)
    m[start : start + run] = True
    return m


def build_mixed_batch(
    lens: list[tuple[int, int, int]],
    *,
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype = torch.float16,
    dead_fraction: float = 0.0,
    dead_pattern: str = "random",
    head_mask_fraction: float = 0.0,
    pad: int = 0,
    seed: int = 0,
    kv_scale: float = 1.0,
    int4_head_major: bool = False,
) -> MixedBatch:
    """lens: per request (INT2 pages, INT4 tokens, full tokens). Pools are filled with
    quantized random K/V (through the torch writers), slots are shuffled, DEAD positions
    drawn per ``dead_pattern`` and ``pad`` extra unused columns appended to the slot map;
    ``int4_head_major``: the INT4 pool's rows head-major, as the store's."""
    gen = torch.Generator().manual_seed(seed)
    n_pages = max(1, sum(p for p, _, _ in lens))
    n4 = max(1, sum(t for _, t, _ in lens))
    nf = 1 + max(1, sum(t for _, _, t in lens))
    pools = KVPools.allocate(nf, n4, n_pages, hkv, d, dtype, int4_head_major=int4_head_major)

    def rnd(*shape: int) -> torch.Tensor:
        # a per-channel offset makes keys look like real ones (outlier channels)
        x = torch.randn(*shape, generator=gen) + 2.0 * torch.randn(shape[-1], generator=gen)
        return (x * kv_scale).to(dtype)

    pools.full.k.copy_(rnd(nf, hkv, d))
    pools.full.v.copy_(rnd(nf, hkv, d))
    write_int4(pools.int4, torch.arange(n4), rnd(n4, hkv, d), rnd(n4, hkv, d), backend="torch")
    write_int2_pages(
        pools.int2,
        torch.arange(n_pages),
        rnd(32 * n_pages, hkv, d),
        rnd(32 * n_pages, hkv, d),
        backend="torch",
    )
    page_perm = torch.randperm(n_pages, generator=gen)
    int4_perm = torch.randperm(n4, generator=gen)
    full_perm = torch.randperm(nf - 1, generator=gen) + 1  # slot 0 is DEAD
    b = len(lens)
    length = max(p * 32 + t4 + tf for p, t4, tf in lens) + pad
    slot_map = torch.zeros(b, max(1, length), dtype=torch.int32)
    ip = i4 = i_f = 0
    for r, (p, t4, tf) in enumerate(lens):
        pages = page_perm[ip : ip + p]
        ip += p
        rows = pools.int2_slot_ids(pages)  # [p, 32]
        # shuffle rows inside each page: the kernel takes the row from the slot id
        rows = torch.gather(rows, 1, torch.argsort(torch.rand(rows.shape, generator=gen), 1))
        ids = torch.cat(
            [
                rows.flatten(),
                pools.int4_base + int4_perm[i4 : i4 + t4],
                full_perm[i_f : i_f + tf],
            ]
        )
        i4 += t4
        i_f += tf
        n = ids.numel()
        dead = _dead_mask(n, dead_fraction, dead_pattern, gen)
        slot_map[r, :n] = torch.where(dead, 0, ids).to(torch.int32)
    seq_lens = torch.tensor([p * 32 + t4 + tf for p, t4, tf in lens], dtype=torch.int32)
    int2_lens = torch.tensor([p * 32 for p, _, _ in lens], dtype=torch.int32)
    int4_lens = torch.tensor([t4 for _, t4, _ in lens], dtype=torch.int32)
    head_mask = None
    if head_mask_fraction > 0:
        head_mask = torch.rand(b, hkv, slot_map.shape[1], generator=gen) >= head_mask_fraction
    q = (torch.randn(b, hq, d, generator=gen) * 2.0).to(dtype)

    def dev(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(DEVICE)

    if DEVICE.type == "cuda":
        pools = _pools_to(pools, DEVICE)
    return MixedBatch(
        pools,
        dev(q),
        dev(slot_map),
        dev(seq_lens),
        dev(int2_lens),
        dev(int4_lens),
        dev(head_mask),
    )


def _pools_to(pools: KVPools, device: torch.device) -> KVPools:
    from dataclasses import fields, replace

    def move(obj):  # type: ignore[no-untyped-def]
        if obj is None:
            return None
        # the constructor's fields (optional tensors: None; not a pool's remembered row map)
        moved = {f.name: getattr(obj, f.name) for f in fields(obj) if f.init}
        return replace(
            obj,
            **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()},
        )

    int4 = move(pools.int4)
    if int4 is not None and pools.int4.scales_interleaved:  # keep one interleaved buffer
        buf = torch.stack([int4.k_scale, int4.k_zero, int4.v_scale, int4.v_zero], dim=2)
        if pools.int4.head_major:  # (the codes kept their head-major strides)
            buf = buf.transpose(0, 1).contiguous().transpose(0, 1)
        int4.k_scale, int4.k_zero, int4.v_scale, int4.v_zero = buf.unbind(2)
    return KVPools(move(pools.full), int4, move(pools.int2))


def int4_head_major(pools: KVPools) -> KVPools:
    """The same pools with the INT4 pool's values in a head-major pool
    (``Int4Pool.allocate(head_major=True)``: each head's slots adjacent rows)."""
    p4 = pools.int4
    s, hkv, _ = p4.k.shape
    new = Int4Pool.allocate(s, hkv, pools.head_dim, p4.k.device, head_major=True)
    for name in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero"):
        getattr(new, name).copy_(getattr(p4, name))
    new.k_channel = p4.k_channel
    assert new.head_major and new.scales_interleaved
    return KVPools(pools.full, new, pools.int2)


def separate_int4_scales(pools: KVPools) -> None:
    """The INT4 pool's scales and zeros as four contiguous tensors (``allocate`` interleaves
    them in one buffer; the kernels accept both)."""
    q4 = pools.int4
    assert q4.scales_interleaved

    def separate(t: torch.Tensor) -> torch.Tensor:  # its own buffer, rows ordered as the codes
        return t.transpose(0, 1).contiguous().transpose(0, 1) if q4.head_major else t.contiguous()

    q4.k_scale, q4.k_zero, q4.v_scale, q4.v_zero = (
        separate(t) for t in (q4.k_scale, q4.k_zero, q4.v_scale, q4.v_zero)
    )
    assert not q4.scales_interleaved


#: the INT4 stacked-path knobs, all off (``DecodeConfig()`` has them on since sessions 10-11)
KNOBS_OFF = dict(
    int4_imma=False,
    int4_lazy_rescale=False,
    int4_v_subnormal=False,
    int4_v_dots8=False,
    int4_offsets32=False,
    int4_live_from_scales=False,
)

#: the same knobs all on (what ``DecodeConfig()``'s stacked path runs since session 10)
KNOBS_ON = {k: True for k in KNOBS_OFF}


def int4_config(**on):  # type: ignore[no-untyped-def]
    """A ``DecodeConfig`` with the INT4 stacked-path knobs off except those given."""
    from agentkv.kernels import DecodeConfig

    return DecodeConfig(**(KNOBS_OFF | on))
