"""Explicit attention probabilities for scorers (SnapKV windows, H2O sums, IntentKV scores)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from agentkv.methods.base import ObserveRequest, PrefillObserver


def attention_probs(
    q: torch.Tensor,
    q_positions: torch.Tensor | None,
    k: torch.Tensor,
    k_positions: torch.Tensor | None,
    head_mask: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of queries over keys, float32.

    Args:
        q: ``[Hq, n, D]`` post-RoPE queries.
        q_positions: int64 ``[n]``; with ``k_positions`` (``[m]``) enables the causal mask
            (query ``i`` sees key ``j`` iff ``k_positions[j] <= q_positions[i]``). None: no
            causal mask.
        k: ``[Hkv, m, D]`` post-RoPE keys (``Hq`` a multiple of ``Hkv``).
        head_mask: bool ``[Hkv, m]``, False = that KV head no longer has that key.
        key_mask: bool ``[m]``, False = key excluded for every head.

    Returns:
        float32 ``[Hq, n, m]``, rows summing to 1 over visible keys (all-zero rows when a
        query sees no key).
    """
    hq, hkv = q.shape[0], k.shape[0]
    g = hq // hkv
    kf = k.float().repeat_interleave(g, dim=0)
    logits = torch.matmul(q.float(), kf.transpose(1, 2)) / math.sqrt(q.shape[-1])
    visible = torch.ones(logits.shape[1:], dtype=torch.bool, device=logits.device)
    if q_positions is not None and k_positions is not None:
        visible = k_positions[None, :] <= q_positions[:, None]
    visible = visible[None].expand(hq, -1, -1)
    if head_mask is not None:
        visible = visible & head_mask.repeat_interleave(g, dim=0)[:, None, :]
    if key_mask is not None:
        visible = visible & key_mask[None, None, :]
    logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)


@dataclass
class _ChunkSeen:
    """What one prefill chunk adds to :class:`AttentionColumnSums`' ``counts``, ``seen`` and
    ``head_live``: the same at every layer (the chunk's positions and head mask do not
    change between layers), so written once for the run of layers ``first..last``.

    Attributes:
        key: the chunk's ``(q_positions, k_positions, head_mask)`` objects.
        pos: int64 ``[m]``, the keys' positions; visible: float32 ``[m]``, observed queries
            that see each key; seen: bool ``[m]``; live: bool ``[Hkv, m]`` (None: every head).
        any_sel: bool scalar (window path): whether any query of the chunk is observed; None:
            always.
    """

    key: tuple
    first: int
    last: int
    pos: torch.Tensor
    visible: torch.Tensor
    seen: torch.Tensor
    live: torch.Tensor | None
    any_sel: torch.Tensor | None = None


class AttentionColumnSums(PrefillObserver):
    """Prefill observer: per layer, the attention each key receives from the observed queries
    (those at positions ``>= first_query``), for attention-statistics scorers (SnapKV, H2O).

    Attributes:
        sums: float32 ``[L, Hq, T]``, summed softmax probabilities per query head and key.
        counts: float32 ``[L, T]``, observed queries that can see each key (causal).
        seen: bool ``[L, T]``, key was visible to the observer in that layer.
        head_live: bool ``[L, Hkv, T]``, the KV head still held the key when it was observed.

    The buffers live on the device of the observed tensors (no host copy per layer: on a GPU
    every copy would stall the prefill), and stay there after :meth:`result`: SnapKV and H2O
    rank on that device and read back only what their plan needs.
    With ``first_query > 0`` and ``q_positions`` off the CPU, the window's queries are masked,
    not selected (:meth:`_observe_window`: no host read either).
    """

    def __init__(self, req: ObserveRequest, first_query: int = 0):
        s = req.shape
        self.first_query = first_query
        self.seq_len = req.seq_len
        self.sums = torch.zeros(s.num_layers, s.num_q_heads, req.seq_len)
        self.counts = torch.zeros(s.num_layers, req.seq_len)
        self.seen = torch.zeros(s.num_layers, req.seq_len, dtype=torch.bool)
        self.head_live = torch.zeros(s.num_layers, s.num_kv_heads, req.seq_len, dtype=torch.bool)
        self._pending: _ChunkSeen | None = None

    def observe(self, layer, q, q_positions, k, k_positions, head_mask):
        key = (q_positions, k_positions, head_mask)
        if self.first_query > 0:
            if q_positions.device.type != "cpu":
                self._observe_window(layer, q, q_positions, k, k_positions, head_mask)
                return
            sel = q_positions >= self.first_query
            if not bool(sel.any()):
                return
            q, q_positions = q[:, sel], q_positions[sel]
        probs = attention_probs(q, q_positions, k, k_positions, head_mask)
        self._move(probs.device)
        pos = k_positions.to(probs.device)
        self.sums[layer][:, pos] += probs.sum(dim=1)
        if self._extends(layer, key):
            return
        visible = (k_positions[None, :] <= q_positions[:, None]).sum(dim=0).to(probs.device)
        held = self._held(head_mask, probs.device)
        if (
            held is not None
        ):  # a key no KV head holds (DEAD, fed masked) is neither seen nor counted
            visible = visible * held
        seen = torch.ones_like(pos, dtype=torch.bool) if held is None else held
        live = None if head_mask is None else head_mask.to(probs.device)
        self._pending = _ChunkSeen(key, layer, layer, pos, visible.to(torch.float32), seen, live)

    def _observe_window(self, layer, q, q_positions, k, k_positions, head_mask):
        """:meth:`observe` for ``first_query > 0`` without a host read: the queries before
        ``first_query`` get zero weight instead of being selected out (a selection reads its
        length back). Same result as the selection for ascending ``q_positions < seq_len``
        (every caller's prefill chunk): the window's queries are then among the last
        ``seq_len - first_query`` rows, the only ones computed."""
        key = (q_positions, k_positions, head_mask)
        w = self.seq_len - self.first_query
        if q.shape[1] > w:
            q, q_positions = q[:, -w:], q_positions[-w:]
        sel = q_positions >= self.first_query  # [n]
        probs = attention_probs(q, q_positions, k, k_positions, head_mask)
        probs = torch.where(sel[None, :, None], probs, 0.0)
        self._move(probs.device)
        pos = k_positions.to(probs.device)
        self.sums[layer][:, pos] += probs.sum(dim=1)
        if self._extends(layer, key):
            return
        visible = ((k_positions[None, :] <= q_positions[:, None]) & sel[:, None]).sum(dim=0)
        visible = visible.to(probs.device)
        any_sel = sel.any().to(probs.device)  # stays on the device
        held = self._held(head_mask, probs.device)
        seen = any_sel.expand(pos.shape[0])
        if held is not None:  # a key no KV head holds (DEAD, fed masked): neither
            visible, seen = visible * held, seen & held
        live = None if head_mask is None else head_mask.to(probs.device)
        self._pending = _ChunkSeen(
            key, layer, layer, pos, visible.to(torch.float32), seen, live, any_sel
        )

    def _extends(self, layer: int, key: tuple) -> bool:
        """Whether this layer's call continues the pending chunk (the same positions and head
        mask objects, the next layer): its counts, seen flags and held heads are the pending
        ones, recorded for the whole run of layers at once. Otherwise the pending chunk is
        written out and the caller computes this one's."""
        p = self._pending
        if (
            p is not None
            and layer == p.last + 1
            and all(a is b for a, b in zip(key, p.key, strict=True))
        ):
            p.last = layer
            return True
        self._flush()
        return False

    def _flush(self) -> None:
        """Write the pending chunk's counts, seen flags and held heads into its layers."""
        p, self._pending = self._pending, None
        if p is None:
            return
        layers = slice(p.first, p.last + 1)
        counts, seen, held = self.counts[layers], self.seen[layers], self.head_live[layers]
        counts[:, p.pos] += p.visible
        seen[:, p.pos] = seen[:, p.pos] | p.seen
        live = True if p.live is None else p.live[None]
        if p.any_sel is None:
            held[:, :, p.pos] = live
        else:
            held[:, :, p.pos] = torch.where(p.any_sel, live, held[:, :, p.pos])

    @staticmethod
    def _held(head_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        """bool ``[m]``: whether any KV head holds each key (None: all do)."""
        return None if head_mask is None else head_mask.to(device).any(dim=0)

    def result(self) -> AttentionColumnSums:
        """The sums, on the observed device (the CPU when nothing was observed)."""
        self._flush()
        return self

    def _move(self, device: torch.device) -> None:
        """The buffers to ``device``; before the first observation made there as zeros (a
        copy of host zeros would make the host wait for the device's queue)."""
        if self.sums.device != device:
            bufs = (self.sums, self.counts, self.seen, self.head_live)
            fresh = self.sums.device.type == "cpu" and not bool(self.seen.any())
            self.sums, self.counts, self.seen, self.head_live = (
                torch.zeros_like(t, device=device) if fresh else t.to(device) for t in bufs
            )
