"""Each decoder layer's input hidden state, for methods that score from it (KVzap).

:func:`install_hidden_state_hooks` registers one ``forward_pre_hook`` per decoder layer
(``model.model.layers[i]``). During an agentkv forward pass the layer's keyword arguments
carry the :class:`~agentkv.engine.store_cache.StoreCache` (``agentkv_cache``), and through it
the request's observer and logical positions; the hook hands the layer input
``hidden [n, D_h]`` (the residual stream, before ``input_layernorm``) to
``observer.observe_hidden(layer, hidden, positions)``. Passes without an observer (plain
decode, teacher forcing, forks) cost one dict lookup per layer.

The SGLang extension reproduces this with the same hook on SGLang's decoder layers (see
docs/engine.md, "Hidden states for KVzap").
"""

from __future__ import annotations

from typing import Any

import torch

from agentkv.engine.store_cache import CACHE_KWARG

_INSTALLED = "_agentkv_hidden_hooks"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a HF causal LM (``model.model.layers``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no model.layers: cannot hook hidden states")
    return list(layers)


def install_hidden_state_hooks(model: torch.nn.Module) -> None:
    """Register the pre-hooks once per model (idempotent)."""
    if getattr(model, _INSTALLED, False):
        return
    for i, layer in enumerate(decoder_layers(model)):
        layer.register_forward_pre_hook(_hook(i), with_kwargs=True)
    setattr(model, _INSTALLED, True)


def _hook(layer_idx: int):
    def pre_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache = kwargs.get(CACHE_KWARG)
        observer = getattr(cache, "observer", None)
        if observer is None:
            return
        hidden = args[0] if args else kwargs["hidden_states"]
        observer.observe_hidden(layer_idx, hidden[0], cache.positions)

    return pre_hook
