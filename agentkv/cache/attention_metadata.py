"""Attention metadata with the dead slot dropped.

Attention must never read DEAD: these builders turn slot maps into index lists that leave
evicted positions out, instead of masking them with a sentinel K value (``q . k`` takes either
sign, so no K value acts as a mask).

- :func:`build_layer_kv_index`: one request, one layer, for the torch attention path: the
  slots to gather, their logical positions (for causal masks / RoPE-aware code) and, when some
  KV heads were evicted separately, a per-KV-head key mask.
- :func:`build_batch_kv_indices`: several requests, layer-independent, in the CSR layout of
  SGLang's triton / flashinfer backends (``kv_indptr``, ``kv_indices``). Per-head masks are
  not applied there; a kernel that supports them reads the request's ``keep_mask``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentkv.cache.dead_slot import DEAD
from agentkv.cache.slot_map import SlotMap


@dataclass(frozen=True)
class LayerKVIndex:
    """What one layer of one request attends to.

    Attributes:
        slots: int64 ``[n]`` pool rows to gather, position order, never DEAD.
        positions: int64 ``[n]`` logical positions of those rows.
        head_mask: bool ``[Hkv, n]``, ``True`` where KV head ``h`` may attend to key ``j``;
            ``None`` when every head sees every listed key. Expand over the query heads of each
            GQA group before use.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    head_mask: torch.Tensor | None


@dataclass(frozen=True)
class BatchKVIndices:
    """CSR KV index of a batch (one row per request), DEAD dropped.

    Attributes:
        kv_indptr: int64 ``[B + 1]``; request ``b`` owns
            ``kv_indices[kv_indptr[b] : kv_indptr[b + 1]]``.
        kv_indices: int64 ``[nnz]`` pool slots, position order within each request.
        kv_positions: int64 ``[nnz]`` logical positions of those slots.
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_positions: torch.Tensor


def build_layer_kv_index(
    slot_map: SlotMap, layer: int, device: torch.device | str | None = None
) -> LayerKVIndex:
    """Index list of ``layer`` for one request: positions that are not DEAD and have at least
    one live KV head in this layer. Tensors are placed on ``device`` (default CPU)."""
    keep = slot_map.layer_live(layer)
    positions = torch.nonzero(keep).reshape(-1)
    slots = slot_map.slots[positions]
    head_mask = None
    mask = slot_map.keep_mask
    if mask is not None:
        hm = mask[layer][:, positions]
        if not bool(hm.all()):
            head_mask = hm.to(device) if device is not None else hm.clone()
    if device is not None:
        slots, positions = slots.to(device), positions.to(device)
    return LayerKVIndex(slots=slots, positions=positions, head_mask=head_mask)


def build_batch_kv_indices(
    slot_maps: Sequence[SlotMap], device: torch.device | str | None = None
) -> BatchKVIndices:
    """Concatenate the resident (non-DEAD) positions of each map into CSR form."""
    lens = []
    idx, pos = [], []
    for m in slot_maps:
        p = torch.nonzero(m.slots != DEAD).reshape(-1)
        pos.append(p)
        idx.append(m.slots[p])
        lens.append(int(p.numel()))
    indptr = torch.zeros(len(slot_maps) + 1, dtype=torch.int64)
    if lens:
        indptr[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    kv_indices = torch.cat(idx) if idx else torch.empty(0, dtype=torch.int64)
    kv_positions = torch.cat(pos) if pos else torch.empty(0, dtype=torch.int64)
    if device is not None:
        indptr, kv_indices, kv_positions = (
            indptr.to(device),
            kv_indices.to(device),
            kv_positions.to(device),
        )
    return BatchKVIndices(kv_indptr=indptr, kv_indices=kv_indices, kv_positions=kv_positions)
