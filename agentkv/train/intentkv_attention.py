"""Fidelity-aligned labels for IntentKV's residual head: what the next reply attends to.

Replay fidelity (top-1 agreement with FullCache) is decided by the logits of the reference
continuation, the next assistant message teacher-forced after the prompt. A history token
matters to it in proportion to the attention those logits' queries pay it. For a prompt of
``n`` tokens followed by the continuation's ``m`` tokens (``T = n + m`` ids, the engine's own
rendering), the scored queries are positions ``n - 1 .. T - 2`` (the last prompt token
predicts the first reply token, ...; exactly the ``m`` logits replay compares), and::

    mass_i = 1/(L Hq) sum_l sum_h sum_{j = n-1}^{T-2} a^{l,h}_{j,i}     (i < n)

with ``a^{l,h}`` FullCache's softmax attention (eager, on the same ids). **Mean over layers
and query heads, not max over heads:** eviction removes a position from every layer and head
at once, so what the reply loses is the sum of what every head reads from it; a max would
reward tokens that one positional head (previous-token, sink) stares at and the others
ignore. The mean is also the rule score's own aggregation (``intentkv.py`` step 4) with the
true future queries in place of the memory probe: the label is the oracle the rule
approximates.

A candidate is positive when it is among the top ``k`` candidates by ``mass``; by default
``k`` is what the policy keeps (``max(B - |forced|, 0)`` under the total budget reading), i.e.
the set an oracle that saw the reply's queries would keep. Unlike the argument labels no
token is excluded (template tokens carry attention the reply needs too).

Memory: one forward pass with eager attention and a hook per layer that reduces the layer's
``[Hq, T, T]`` probabilities to ``[n]`` at once, so no such tensor outlives its layer.
"""

from __future__ import annotations

from typing import Any

import torch


class AttentionLabeler:
    """FullCache attention mass of the reference continuation on the prompt positions.

    Args:
        model: a HF causal LM loaded with ``attn_implementation="eager"`` (the engine's own
            model uses agentkv's attention function, which returns no probabilities), e.g.
            :func:`agentkv.train.kvzap_fit.load_eager_model`.
    """

    def __init__(self, model: Any):
        self.model = model

    @staticmethod
    def load(model: str | None, device: str | None) -> AttentionLabeler:
        from agentkv.train.kvzap_fit import load_eager_model

        return AttentionLabeler(load_eager_model(model, device)[0])

    def continuation_mass(self, input_ids: torch.Tensor, n_prompt: int) -> torch.Tensor:
        """float32 ``[n_prompt]``: ``mass_i`` (module docstring) for ``input_ids [T]`` = the
        prompt's ``n_prompt`` ids then the continuation's."""
        T = int(input_ids.numel())
        if not 0 < n_prompt < T:
            raise ValueError(f"n_prompt: need 0 < n_prompt < {T}, got {n_prompt}")
        layers = self.model.model.layers
        mass = torch.zeros(n_prompt, dtype=torch.float64)
        queries = slice(n_prompt - 1, T - 1)
        heads = [0]

        def hook(module, args, kwargs, output):
            probs = output[1]
            if probs is None:
                raise RuntimeError("load the model with attn_implementation='eager'")
            p = probs[0, :, queries, :n_prompt].float()  # [Hq, m, n]
            heads[0] = p.shape[0]
            mass.add_(p.sum(dim=(0, 1)).double().cpu())

        handles = [
            layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in layers
        ]
        try:
            device = next(self.model.parameters()).device
            with torch.inference_mode():
                self.model.model(input_ids=input_ids[None].to(device), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        return (mass / (len(layers) * heads[0])).float()


def kept_by_policy(n_live: int, n_candidates: int, budget: int, budget_scope: str) -> int:
    """How many candidates IntentKV keeps at a compression event (its top-k size)."""
    if budget_scope == "total":
        return max(budget - (n_live - n_candidates), 0)
    return min(budget, n_candidates)


def attention_labels(mass: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """int8 ``[T]``: 1 for the top ``k`` candidates by ``mass [>= T']`` (ties by position),
    0 for the other candidates, -1 for non-candidates (``candidates`` bool ``[T]``)."""
    T = candidates.numel()
    labels = torch.full((T,), -1, dtype=torch.int8)
    idx = torch.nonzero(candidates).reshape(-1)
    labels[idx] = 0
    k = min(max(k, 0), idx.numel())
    if k:
        order = torch.sort(mass[idx].double(), descending=True, stable=True).indices
        labels[idx[order[:k]]] = 1
    return labels
