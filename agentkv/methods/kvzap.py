"""KVzap (kvzap.txt): a learned surrogate scores every KV pair; prune below a threshold.

Per layer ``l``, the surrogate (:mod:`agentkv.methods.kvzap_surrogate`) maps the layer's input
hidden state ``h_t`` to ``Hkv`` predicted ``log s+`` scores (KVzip+). A (layer, KV head,
position) entry is kept iff its score is ``>= threshold`` or the position is one of the last
``window`` positions; the decision is per KV head (``Plan.keep_mask [L, Hkv, T]``), so the
compression ratio adapts to the input.

- Prefill: the observer receives each computed position's layer inputs through the engine's
  hidden-state hooks and fills a score buffer ``[L, Hkv, T]``.
- Later turns of a session: positions reused from the prefix cache are not recomputed; their
  scores come from the session's previous buffer (an LRU of :data:`SESSION_CAPACITY`
  sessions). Positions with no score (another session's shared prefix) are kept.
- Decode: the buffer keeps growing with the decoded positions; every ``decode_interval``
  steps :meth:`KVzapMethod.plan_decode` evicts the positions that left the window since the
  last pass and score below the threshold (kvzap.txt Algorithm 1 with a score buffer so the
  window slides). A decode step replayed from a CUDA graph (the embedded engine's kernels
  path) runs no Python: its capture wrote each layer's input row into a device ring
  (:data:`RING_ROWS` rows, slot ``position % RING_ROWS``, with the row's position), which
  :meth:`KVzapScores.collect` scores (also before any score is read).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from agentkv.methods.base import (
    DecodeContext,
    Method,
    ObserveRequest,
    Plan,
    PlanContext,
    PrefillObserver,
    register_method,
)
from agentkv.methods.kvzap_surrogate import Surrogate, shipped_surrogate, surrogate_from_path
from agentkv.policies import KVPolicy, KVzap
from agentkv.session import is_request_local

#: sessions whose score buffers are kept for their next turn.
SESSION_CAPACITY = 64
#: layer inputs of at most this many rows (decode steps, short teacher-forced spans) are not
#: scored when they arrive but kept and scored for every layer at once when scores are read
#: (one batched surrogate call per pruning pass instead of one per layer and step).
DEFER_MAX_ROWS = 64
#: rows of the ring that decode steps captured in a CUDA graph write their layer inputs into
#: (no Python runs when a graph replays); collected at least every this many steps.
RING_ROWS = 64


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class KVzapScores(PrefillObserver):
    """The request's score buffer, filled from layer inputs (prefill, then decode).

    Attributes:
        scores: float32 ``[L, Hkv, capacity]`` predicted ``log s+`` (on the model's device).
        known: bool ``[capacity]``, position scored (computed by this request, or taken from
            the session's previous buffer).
        pruned_until: positions below it have been through a plan.
    """

    reads_keys = False  # observe() reads nothing: scores come from hidden states
    collect_every = RING_ROWS  # (the ring's rows: collected before they are overwritten)

    def __init__(self, surrogate: Surrogate, req: ObserveRequest):
        self.surrogate = surrogate
        self.shape = req.shape
        self.capacity = max(req.seq_len, 1)
        self.scores: torch.Tensor | None = None
        self.known: torch.Tensor | None = None
        self.pruned_until = 0
        #: deferred ``(layer, hidden [n, D_h], positions [n])`` of small passes.
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        #: captured steps' layer inputs ``[L, RING_ROWS, D_h]`` and their positions
        #: (int64 ``[RING_ROWS]``, -1: nothing to score), made by :meth:`before_capture`
        self._ring: torch.Tensor | None = None
        self._ring_pos: torch.Tensor | None = None

    def _ensure(self, end: int, device: torch.device) -> None:
        if self.scores is None:
            s = self.shape
            self.scores = torch.zeros(s.num_layers, s.num_kv_heads, self.capacity, device=device)
            self.known = torch.zeros(self.capacity, dtype=torch.bool, device=device)
        if end > self.capacity:
            grow = max(end, 2 * self.capacity) - self.capacity
            assert self.known is not None
            self.scores = torch.cat(
                [self.scores, self.scores.new_zeros(*self.scores.shape[:2], grow)], -1
            )
            self.known = torch.cat([self.known, self.known.new_zeros(grow)])
            self.capacity += grow

    def observe(self, layer, q, q_positions, k, k_positions, head_mask) -> None:
        """Attention inputs are not needed (scores come from hidden states)."""

    def observe_hidden(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        if hidden.shape[-1] != self.surrogate.meta.hidden_size:
            raise ValueError(
                f"KVzap surrogate expects hidden size {self.surrogate.meta.hidden_size}, "
                f"the model has {hidden.shape[-1]}"
            )
        if hidden.shape[0] <= DEFER_MAX_ROWS:
            if _capturing(hidden):  # replays will rewrite ``hidden``: keep a copy per step
                self._record(layer, hidden, positions)
            else:
                self._pending.append((layer, hidden, positions))
            return
        self._flush()
        self._store(layer, hidden, positions, self.surrogate.score(layer, hidden).T)

    def before_capture(self, device: torch.device, dtype: torch.dtype) -> None:
        """Make the ring (once a decode: every graph of it writes there)."""
        if self._ring is None:
            L, D = self.shape.num_layers, self.surrogate.meta.hidden_size
            self._ring = torch.zeros(L, RING_ROWS, D, device=device, dtype=dtype)
            self._ring_pos = torch.full((RING_ROWS,), -1, dtype=torch.int64, device=device)

    def _record(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """Copy ``hidden [n, D_h]`` into the ring at slots ``positions % RING_ROWS`` (device
        ops only: this runs while a decode step is captured, ``positions`` on the device)."""
        if self._ring is None or self._ring_pos is None:
            raise RuntimeError("KVzapScores: a decode step captured without before_capture()")
        slots = torch.remainder(positions, RING_ROWS)
        self._ring[layer].index_copy_(0, slots, hidden)
        if layer == 0:
            self._ring_pos.index_copy_(0, slots, positions)

    def collect(self) -> None:
        """Score the rows replayed steps left in the ring (one device sync)."""
        self._flush()

    def end_decode(self) -> None:
        """The request's decode ended: score what is left, free the ring (made again by the
        next capture)."""
        self._flush()
        self._ring = self._ring_pos = None

    def _store(self, layer: int | slice, hidden, positions, scores: torch.Tensor) -> None:
        """Write ``scores`` (``[Hkv, n]`` for one layer, ``[L, Hkv, n]`` for ``slice(None)``)."""
        end = int(positions[-1]) + 1
        self._ensure(end, hidden.device)
        assert self.scores is not None and self.known is not None
        pos = positions.to(hidden.device)
        if isinstance(layer, int):
            self.scores[layer][:, pos] = scores
        else:
            self.scores[:, :, pos] = scores
        if layer == 0 or isinstance(layer, slice):
            self.known[pos] = True

    @torch.inference_mode()  # the buffers were made in the engine's inference mode
    def _flush(self) -> None:
        """Score the deferred layer inputs: every layer at once when each layer saw the same
        passes (the same ``positions`` objects, as one forward gives every layer), else one
        layer at a time. First the rows replayed steps left in the ring."""
        self._collect_ring()
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        L = self.shape.num_layers
        rows: list[list[torch.Tensor]] = [[] for _ in range(L)]
        pos: list[list[torch.Tensor]] = [[] for _ in range(L)]
        for layer, hidden, positions in pending:
            rows[layer].append(hidden)
            pos[layer].append(positions)
        same = all(
            len(pos[i]) == len(pos[0]) and all(a is b for a, b in zip(pos[i], pos[0], strict=True))
            for i in range(L)
        )
        if same and pos[0]:
            n = sum(h.shape[0] for h in rows[0])
            hidden = torch.cat([h for layer_rows in rows for h in layer_rows]).view(L, n, -1)
            positions = torch.cat([p.reshape(-1) for p in pos[0]])
            self._store(slice(None), hidden, positions,
                        self.surrogate.score_all(hidden).transpose(1, 2))  # fmt: skip
            return
        for layer, hidden, positions in pending:
            self._store(layer, hidden, positions, self.surrogate.score(layer, hidden).T)

    def _collect_ring(self) -> None:
        if self._ring is None or self._ring_pos is None:
            return
        pos = self._ring_pos.cpu()
        slots = torch.nonzero(pos >= 0).reshape(-1)
        if not slots.numel():
            return
        slots = slots[torch.argsort(pos[slots])]  # (in position order)
        hidden = self._ring[:, slots.to(self._ring.device)]  # [L, n, D_h]
        self._store(slice(None), hidden, pos[slots],
                    self.surrogate.score_all(hidden).transpose(1, 2))  # fmt: skip
        self._ring_pos.fill_(-1)

    def window_scores(self, start: int, end: int) -> torch.Tensor:
        """float32 CPU ``[L, Hkv, end - start]``; unknown positions read ``+inf`` (kept)."""
        self._flush()
        s = self.shape
        if self.scores is None or self.known is None:
            return torch.full((s.num_layers, s.num_kv_heads, end - start), float("inf"))
        self._ensure(end, self.scores.device)
        sc = self.scores[:, :, start:end].float().cpu()
        known = self.known[start:end].cpu()
        return sc.masked_fill(~known[None, None, :], float("inf"))

    @torch.inference_mode()  # the buffers were made in the engine's inference mode
    def adopt(self, prev: KVzapScores, upto: int) -> None:
        """Take the scores of positions ``< upto`` this request did not compute from ``prev``
        (the session's previous buffer: same tokens, reused from the prefix cache)."""
        prev._flush()
        self._flush()
        if prev.scores is None or prev.known is None or upto <= 0:
            return
        upto = min(upto, prev.capacity)
        device = prev.scores.device if self.scores is None else self.scores.device
        self._ensure(upto, device)
        assert self.scores is not None and self.known is not None
        take = (~self.known[:upto]) & prev.known[:upto].to(device)
        self.scores[:, :, :upto][:, :, take] = prev.scores[:, :, :upto].to(device)[:, :, take]
        self.known[:upto] |= take

    def scored_prefix(self) -> int:
        """Length of the leading run of scored positions."""
        self._flush()
        if self.known is None:
            return 0
        unknown = torch.nonzero(~self.known).reshape(-1)
        return int(unknown[0]) if unknown.numel() else self.capacity

    def result(self) -> KVzapScores:
        return self


@register_method
class KVzapMethod(Method):
    name = "kvzap"

    def __init__(self, shape):
        super().__init__(shape)
        self._surrogates: dict[tuple[str, str | None], Surrogate] = {}
        self._sessions: OrderedDict[str, KVzapScores] = OrderedDict()

    def surrogate(self, policy: KVzap) -> Surrogate:
        key = (policy.surrogate, policy.surrogate_path)
        sur = self._surrogates.get(key)
        if sur is None:
            if policy.surrogate_path is None:
                sur = shipped_surrogate(policy.surrogate, self.shape)
            else:
                sur = surrogate_from_path(policy.surrogate_path, policy.surrogate, self.shape)
            self._surrogates[key] = sur
        return sur

    def check(self, policy: KVPolicy) -> None:
        assert isinstance(policy, KVzap)
        self.surrogate(policy)

    def observer(self, policy: KVPolicy, req: ObserveRequest) -> PrefillObserver | None:
        assert isinstance(policy, KVzap)
        return KVzapScores(self.surrogate(policy), req)

    def prefix_reuse(self, policy: KVPolicy, session_id: str, limit: int) -> int:
        """Only the session's own scored positions come from the prefix cache: a position
        reused without a score could not be pruned (other sessions' prefixes are recomputed)."""
        prev = self._sessions.get(session_id)
        return min(limit, 1 + (0 if prev is None else prev.scored_prefix()))

    def decode_interval(self, policy: KVPolicy) -> int:
        assert isinstance(policy, KVzap)
        return policy.decode_interval

    def plan(self, ctx: PlanContext) -> Plan:
        policy = ctx.policy
        assert isinstance(policy, KVzap)
        obs: KVzapScores = ctx.observation
        T = ctx.seq_len
        prev = self._sessions.get(ctx.session_id)
        if prev is not None and prev is not obs:
            obs.adopt(prev, T)
        scores = obs.window_scores(0, T)  # [L, Hkv, T]
        keep = scores >= policy.threshold
        protected = max(T - policy.window, 0)
        keep[:, :, protected:] = True
        obs.pruned_until = protected
        self._remember(ctx.session_id, obs)
        finite = torch.isfinite(scores)
        return Plan(
            keep_mask=keep,
            scores=scores.masked_fill(~finite, 0.0),
            note=f"kvzap: {int(finite[0, 0].sum())}/{T} positions scored",
        )

    def plan_decode(self, ctx: DecodeContext) -> Plan | None:
        policy = ctx.policy
        assert isinstance(policy, KVzap)
        obs: KVzapScores = ctx.observation
        T = ctx.seq_len
        start, end = obs.pruned_until, max(T - policy.window, 0)
        if end <= start:
            return None
        keep = obs.window_scores(start, end) >= policy.threshold  # [L, Hkv, end - start]
        obs.pruned_until = end
        return Plan(keep_mask=keep, keep_start=start, note="kvzap decode")

    def _remember(self, session_id: str, obs: KVzapScores) -> None:
        if is_request_local(session_id):
            return
        self._sessions[session_id] = obs
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > SESSION_CAPACITY:
            self._sessions.popitem(last=False)

    def end_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
