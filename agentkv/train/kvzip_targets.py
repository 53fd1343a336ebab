"""KVzip+ targets computed by the model itself (kvzap.txt §2.1-2.2).

For a context ``c`` the model reads the repeat prompt (its chat template around)::

    user: <c>\\n\\nRepeat the previous context exactly.
    assistant: <c>

and, for every layer and KV head, each position ``i`` of the original ``<c>`` is scored

    s+_i = max over query heads h of the KV head's GQA group,
               max over positions j of the repeated <c>,   a^h_ji * ||W_O^h v_i|| / ||h_j||

with ``a^h`` the softmax attention of query head ``h``, ``W_O^h`` the columns of ``o_proj`` that
head ``h`` writes through, ``v_i`` the value of ``i`` (of the head's KV head) and ``h_j`` the
hidden state entering the layer at ``j`` (the residual stream, before ``input_layernorm``;
the same vector the surrogate reads). The training target is ``log s+``.

One forward pass with eager attention (``attn_implementation="eager"``, which returns the
attention probabilities) and two hooks per layer: a pre-hook on the decoder layer keeps
``h``; a hook on ``self_attn`` takes the probabilities and the normed input (``v = v_proj``)
and reduces them at once, so no ``[Hq, T, T]`` tensor outlives its layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from agentkv.methods import ModelShape

REPEAT_INSTRUCTION = "\n\nRepeat the previous context exactly."
_MIN_PROB = 1e-30  # log floor: a probability that underflowed to 0


@dataclass
class RepeatPrompt:
    """A tokenized repeat prompt.

    Attributes:
        input_ids: int64 ``[T]``.
        context: token span of the original context.
        repeat: token span of the repeated context (the assistant's copy).
    """

    input_ids: torch.Tensor
    context: slice
    repeat: slice


@dataclass
class KVzipSample:
    """Targets of one context.

    Attributes:
        hidden: ``[L, n, D_h]`` layer inputs at the ``n`` context positions (model dtype, CPU).
        log_scores: float32 ``[L, n, Hkv]`` ``log s+``.
    """

    hidden: torch.Tensor
    log_scores: torch.Tensor


def repeat_prompt(tokenizer: Any, context: str) -> RepeatPrompt:
    """Render and tokenize the repeat prompt; token spans from the character offsets."""
    context = context.strip()
    if not context:
        raise ValueError("empty context")
    messages = [
        {"role": "user", "content": context + REPEAT_INSTRUCTION},
        {"role": "assistant", "content": context},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    first = text.find(context)
    second = text.find(context, first + len(context) + len(REPEAT_INSTRUCTION))
    if first < 0 or second < 0:
        raise ValueError("the chat template does not render the context verbatim")
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    starts = torch.tensor([a for a, _ in enc["offset_mapping"]])

    def span(a: int, b: int) -> slice:
        inside = torch.nonzero((starts >= a) & (starts < b)).reshape(-1)
        return slice(int(inside[0]), int(inside[-1]) + 1)

    return RepeatPrompt(
        torch.tensor(enc["input_ids"]),
        span(first, first + len(context)),
        span(second, second + len(context)),
    )


def _kv_head_scores(
    probs: torch.Tensor,
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    hidden_norm: torch.Tensor,
    prompt: RepeatPrompt,
) -> torch.Tensor:
    """KVzip+ of one layer.

    Args:
        probs: ``[Hq, T, T]`` attention probabilities.
        values: ``[Hkv, T, D]`` values.
        o_proj_weight: ``[D_h, Hq * D]``.
        hidden_norm: ``[T]`` ``||h_j||`` of the layer inputs.

    Returns:
        float32 ``[n, Hkv]`` ``log s+`` at the context positions.
    """
    hq, hkv, d = probs.shape[0], values.shape[0], values.shape[-1]
    g = hq // hkv
    ctx, rep = prompt.context, prompt.repeat
    a = probs[:, rep, ctx].float()  # [Hq, r, n]
    best = (a / hidden_norm[rep].float()[None, :, None]).amax(dim=1)  # [Hq, n]
    v = values[:, ctx].float().repeat_interleave(g, dim=0)  # [Hq, n, D]
    wo = o_proj_weight.float().T.reshape(hq, d, -1)  # [Hq, D, D_h]: W_O^h transposed
    gram = torch.matmul(wo, wo.transpose(1, 2))  # [Hq, D, D] = W_O^hT W_O^h
    wov = torch.einsum("hnd,hde,hne->hn", v, gram, v).clamp_min(0).sqrt()  # ||W_O^h v_i||
    s = (best * wov).view(hkv, g, -1).amax(dim=1)  # [Hkv, n]
    return torch.log(s.clamp_min(_MIN_PROB)).T.contiguous()


def kvzip_plus_scores(model: Any, prompt: RepeatPrompt) -> KVzipSample:
    """Run ``model`` (a HF causal LM loaded with ``attn_implementation="eager"``) over the
    repeat prompt; KVzip+ targets and layer inputs at the context positions."""
    layers = model.model.layers
    cfg = model.config
    hkv = ModelShape.from_config(cfg).num_kv_heads
    n = prompt.context.stop - prompt.context.start
    hidden = torch.empty(len(layers), n, cfg.hidden_size, dtype=model.dtype)
    scores = torch.empty(len(layers), n, hkv)
    inputs: dict[int, torch.Tensor] = {}
    handles = []

    def pre_hook(idx: int):
        def hook(module, args, kwargs):
            h = (args[0] if args else kwargs["hidden_states"])[0]
            inputs[idx] = h
            hidden[idx] = h[prompt.context].detach().cpu()

        return hook

    def attn_hook(idx: int):
        def hook(module, args, kwargs, output):
            probs = output[1]
            if probs is None:
                raise RuntimeError("load the model with attn_implementation='eager'")
            normed = (args[0] if args else kwargs["hidden_states"])[0]
            v = module.v_proj(normed).view(normed.shape[0], hkv, -1).transpose(0, 1)
            h = inputs.pop(idx)
            scores[idx] = _kv_head_scores(
                probs[0], v, module.o_proj.weight, h.float().norm(dim=-1), prompt
            ).cpu()

        return hook

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
        handles.append(layer.self_attn.register_forward_hook(attn_hook(i), with_kwargs=True))
    try:
        device = next(model.parameters()).device
        with torch.inference_mode():
            model.model(input_ids=prompt.input_ids[None].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return KVzipSample(hidden, scores)
