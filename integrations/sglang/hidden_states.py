"""Each decoder layer's input hidden state during SGLang's extend, for methods that score from
it (KVzap).

SGLang's Llama-family decoder layers (``LlamaDecoderLayer``, ``Qwen2DecoderLayer``,
``Qwen3DecoderLayer``, ...) are called as ``layer(positions, hidden_states, forward_batch,
residual)`` and fuse the residual add into ``input_layernorm``: the layer's input, the
residual stream before its norm (what the embedded engine's hook,
:mod:`agentkv.engine.hidden_states`, hands the observer), is ``hidden_states`` at the first
layer (``residual is None``) and ``hidden_states + residual`` after it (``+
post_residual_addition`` where a caller passes one). :func:`install_hidden_state_hooks` puts
one ``forward_pre_hook`` on each of ``model.model.layers`` (no SGLang file patched; the
``agentkv`` attention backend's factory installs them, after SGLang loaded the model).

During an extend batch (``forward_batch.forward_mode.is_extend()``) with a request in
:data:`HIDDEN_OBSERVING`, the hook computes that sum once per layer and hands request ``r``
its rows ``extend_start_loc[r] : extend_start_loc[r] + extend_seq_lens[r]`` (``[n, D_h]``)
at ``forward_batch.positions`` of the same rows (int64 ``[n]``):
``observer.observe_hidden(layer, hidden, positions)``. During a decode batch, each request in
:data:`HIDDEN_DECODING` (pruning while decoding, :mod:`.decode_pruning`) gets its one row.
Other passes (batches without such a request, CUDA-graph capture at start-up) cost one dict
test per layer.

Python hooks do not run when a CUDA graph replays. SGLang 0.5.17 captures decode steps by
default, and on CUDA also prefill (``breakable`` graphs: attention runs eagerly between
captured segments, the decoder layers' entries are inside them): KVzap needs
``--disable-prefill-cuda-graph``, and its decode-time pruning ``--disable-decode-cuda-graph``
(docs/sglang.md, "KVzap"). Steps the hooks miss leave their positions unscored, and KVzap
keeps unscored positions.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch

logger = logging.getLogger("agentkv.sglang")

#: req_pool_idx -> state of requests whose observer takes layer inputs in prefill
#: (scheduler process; ``.observer``).
HIDDEN_OBSERVING: dict[int, Any] = {}
#: req_pool_idx -> decode-time watch of requests that prune while decoding
#: (:class:`~.decode_pruning.DecodeWatch`: ``.observer``, ``.fed``).
HIDDEN_DECODING: dict[int, Any] = {}

_INSTALLED = "_agentkv_hidden_hooks"


class ExtendLayout:
    """Where each request of the running extend batch sits, on the host.

    The scheduler hook records the batch's ``req_pool_idx`` list (:meth:`record`, from the
    ``Req`` objects) before the forward; :meth:`of` combines it with SGLang's host lists
    (``extend_seq_lens_cpu`` / ``extend_prefix_lens_cpu``). Reading ``req_pool_indices``
    back instead, at the first observed layer, would make the scheduler thread wait there
    for the GPU to finish everything queued before it (the fallback when nothing was
    recorded, e.g. a forward run outside ``Scheduler.run_batch``)."""

    def __init__(self) -> None:
        self.pool_idx: list[int] | None = None
        self.reqs: list[Any] | None = None

    def record(self, reqs: list[Any]) -> None:
        self.reqs = list(reqs)
        self.pool_idx = [r.req_pool_idx for r in self.reqs]

    def clear(self) -> None:
        self.pool_idx = self.reqs = None

    def entry(self, table: dict[int, Any], i: int, idx: int, n: int) -> Any:
        """``table[idx]`` for request ``i`` of a batch of ``n`` (at row ``idx``), None when it
        has none. A table is keyed by ``req_pool_idx``, which SGLang reuses: an entry that
        belongs to another request than the one the scheduler put at ``i`` (``req.agentkv``)
        is not this request's (without a record, the row decides, as before)."""
        entry = table.get(idx)
        if entry is None or self.reqs is None or len(self.reqs) != n:
            return entry
        return entry if getattr(self.reqs[i], "agentkv", None) is entry else None

    def of(self, forward_batch: Any) -> tuple[list[int], list[int], list[int], list[int]]:
        """``(pool_idx, starts, lens, prefix)`` of an extend batch: per request its row in
        ``req_to_token``, its first row in the batch, its rows, its cached prefix."""
        pool_idx = self.pool_idx
        if pool_idx is None or len(pool_idx) != len(forward_batch.req_pool_indices):
            pool_idx = forward_batch.req_pool_indices.tolist()
        lens = getattr(forward_batch, "extend_seq_lens_cpu", None)
        prefix = getattr(forward_batch, "extend_prefix_lens_cpu", None)
        if lens is None or prefix is None:
            lens = forward_batch.extend_seq_lens.tolist()
            prefix = forward_batch.extend_prefix_lens.tolist()
        starts = [0, *itertools.accumulate(lens[:-1])]  # extend_start_loc, on the host
        return pool_idx, starts, list(lens), list(prefix)


#: the running extend batch's host layout (scheduler process; see :class:`ExtendLayout`)
EXTEND_LAYOUT = ExtendLayout()


class _BatchRows:
    """Per forward batch, the observed requests' observers, row ranges and positions:
    computed at the first layer, reused by the others (the same ``positions`` objects at
    every layer, so KVzap's deferred scoring batches all layers into one call).

    Extend: request ``i`` owns rows ``extend_start_loc[i] : + extend_seq_lens[i]`` and is
    looked up in :data:`HIDDEN_OBSERVING`. Decode: one row per request, looked up in
    :data:`HIDDEN_DECODING` (whose entry records the position it was fed)."""

    def __init__(self) -> None:
        self.batch: Any = None
        self.extend = True
        self.warned = False
        self.rows: list[tuple[Any, int, int, torch.Tensor]] = []

    def of(self, forward_batch: Any, extend: bool) -> list[tuple[Any, int, int, torch.Tensor]]:
        if forward_batch is self.batch and extend == self.extend:
            return self.rows
        self.batch, self.extend = forward_batch, extend
        self.rows = []
        if extend:
            pool_idx, starts, lens, prefix = EXTEND_LAYOUT.of(forward_batch)
        else:
            pool_idx = forward_batch.req_pool_indices.tolist()
            starts, lens = list(range(len(pool_idx))), [1] * len(pool_idx)
        for i, idx in enumerate(pool_idx):
            if extend:
                entry = EXTEND_LAYOUT.entry(HIDDEN_OBSERVING, i, idx, len(pool_idx))
            else:
                entry = HIDDEN_DECODING.get(idx)
            observer = None if entry is None else entry.observer
            if observer is None or lens[i] == 0:
                continue
            s, n = starts[i], lens[i]
            if extend:
                n = entry.prompt_rows(prefix[i], n)
                if n == 0:
                    continue
            pos = forward_batch.positions[s : s + n].to(torch.int64)
            if not extend:
                entry.fed.append(pos)  # this step's position (read back after the step)
            self.rows.append((observer, s, n, pos))
        return self.rows


_ROWS = _BatchRows()


def layer_input(
    hidden_states: torch.Tensor,
    residual: torch.Tensor | None,
    post_residual_addition: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decoder layer's input ``[N, D_h]`` (the residual stream before ``input_layernorm``)
    from SGLang's ``(hidden_states, residual)`` pair, in the hidden states' dtype."""
    if residual is None:
        return hidden_states
    x = hidden_states + residual
    if post_residual_addition is not None:
        x = x + post_residual_addition
    return x.to(hidden_states.dtype)


def observe_layer_input(
    layer_idx: int,
    hidden_states: torch.Tensor,
    residual: torch.Tensor | None,
    forward_batch: Any,
    post_residual_addition: torch.Tensor | None = None,
) -> None:
    """Hand each observed request of an extend (or eager decode) batch its rows of layer
    ``layer_idx``'s input."""
    if not (HIDDEN_OBSERVING or HIDDEN_DECODING):
        return
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None:
        return
    if mode.is_extend():
        if not HIDDEN_OBSERVING:
            return
        extend = True
    elif mode.is_decode():
        if not HIDDEN_DECODING:  # (a chunked KVzap prefill in progress: no sync per step)
            return
        extend = False
    else:  # idle, target-verify, ...: not observed
        return
    rows = _ROWS.of(forward_batch, extend)
    if not rows:
        return
    if residual is not None and getattr(hidden_states, "_sglang_needs_allreduce_fusion", False):
        # TP > 1 with the all-reduce fused into the next norm: these are partial sums, not
        # the layer input. The request's positions stay unscored (kept).
        if not _ROWS.warned:
            _ROWS.warned = True
            logger.warning("agentkv: KVzap needs TP = 1 (un-reduced layer inputs); not scored")
        return
    x = layer_input(hidden_states, residual, post_residual_addition)
    for observer, s, n, pos in rows:
        observer.observe_hidden(layer_idx, x[s : s + n], pos)


def _hook(layer_idx: int):
    def pre_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not (HIDDEN_OBSERVING or HIDDEN_DECODING):
            return
        # (positions, hidden_states, forward_batch, residual[, post_residual_addition])
        names = ("positions", "hidden_states", "forward_batch", "residual")
        bound = dict(zip(names, args, strict=False)) | kwargs
        extra = args[4] if len(args) > 4 else kwargs.get("post_residual_addition")
        observe_layer_input(
            layer_idx,
            bound["hidden_states"],
            bound.get("residual"),
            bound["forward_batch"],
            extra,
        )

    return pre_hook


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module] | None:
    """SGLang's decoder layers of a causal LM (``model.model.layers``), or None."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return None if layers is None else list(layers)


def install_hidden_state_hooks(model: torch.nn.Module) -> int:
    """Register the pre-hooks once per model (idempotent). Returns the layers hooked (0 when
    the model has no ``model.layers``: KVzap plans then find no scores and evict nothing).

    Layer ``i`` of ``model.model.layers`` reports as layer ``i`` (pipeline parallelism is not
    supported by the plugin; placeholder layers of other ranks have no ``forward`` args)."""
    if getattr(model, _INSTALLED, False):
        return 0
    layers = decoder_layers(model)
    if layers is None:
        logger.warning(
            "agentkv: %s has no model.layers; KVzap requests will find no layer inputs",
            type(model).__name__,
        )
        return 0
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(_hook(i), with_kwargs=True)
    setattr(model, _INSTALLED, True)
    return len(layers)


def reset_rows() -> None:
    """Forget the last batch's rows (the scheduler calls it around every extend batch)."""
    _ROWS.batch = None
    _ROWS.rows = []
