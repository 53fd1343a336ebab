"""The ``agentkv`` attention backend: SGLang's Triton backend, with DEAD dropped from the
attention metadata (``--attention-backend agentkv``).

SGLang's Triton backend builds, per batch, ``kv_indptr`` (int ``[bs + 1]``) and ``kv_indices``
(the slots of every request's positions, request after request) from ``req_to_token``; its
decode and extend kernels read exactly those slots. Evicted positions point at the DEAD slot;
:func:`drop_dead_kv_indices` removes them in place (a stable compaction: surviving slots keep
their order, hence their positions and RoPE phases) and shortens each request's segment, so
the kernels never read DEAD. No K value could stand in for the mask (``q . k`` takes either
sign).

With no request holding a hole (FullCache, or budgets not reached) the metadata is SGLang's,
untouched: FullCache through the plugin runs SGLang's own kernels on SGLang's own indices.

During extend (prefill, chunked prefill included) it also hands the post-RoPE queries of the
requests whose method observes prefill (IntentKV, SnapKV, H2O) to their observers
(:func:`~.runtime.observe_extend`).
"""

from __future__ import annotations

import torch

from agentkv.integrations.sglang.hidden_states import install_hidden_state_hooks
from agentkv.integrations.sglang.host_time import timed
from agentkv.integrations.sglang.request_plan import HOLEY
from agentkv.integrations.sglang.runtime import OBSERVING, observe_extend


@timed("drop_dead")
def drop_dead_kv_indices(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, dead: int) -> None:
    """Remove every ``dead`` entry of ``kv_indices[: kv_indptr[-1]]`` in place and rewrite
    ``kv_indptr`` (``[bs + 1]``, int32 or int64) to match; the live entries left end at the
    new ``kv_indptr[-1]`` (entries after it are stale and never read; entries past the old
    ``kv_indptr[-1]`` are left as they were).

    One stable compaction over the batch: an exclusive prefix sum of the live flags gives each
    live entry its new place, and the prefix sum read at the old segment starts gives the new
    ``kv_indptr``. No host read: the batch's length stays on the device (compared, not read),
    so the pass covers the whole ``kv_indices`` given: exactly the batch in SGLang's eager
    path; on CUDA-graph replay the caller passes the buffer's first ``bs × max context``
    entries (a host-known bound of the batch's length)."""
    n = kv_indices.numel()
    if n == 0:
        return
    end = kv_indptr[-1:].to(torch.int64)  # [1], on the device
    live = (kv_indices != dead) & (torch.arange(n, device=kv_indices.device) < end)
    csum = torch.cumsum(live, dim=0, dtype=torch.int32 if n < 2**31 else torch.int64)
    ends = torch.cat((csum.new_zeros(1), csum))
    new_indptr = ends[kv_indptr.to(torch.int64)]
    target = torch.where(live, csum - 1, torch.full_like(csum, n))
    out = torch.cat((kv_indices, kv_indices.new_empty(1)))  # the rest keeps its old entries
    out.scatter_(0, target, kv_indices)
    kv_indices.copy_(out[:n])
    kv_indptr.copy_(new_indptr.to(kv_indptr.dtype))


def make_backend_class():
    """``AgentKVTritonBackend`` (built on first use: importing SGLang's Triton backend pulls
    in its kernels)."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    class AgentKVTritonBackend(TritonAttnBackend):
        """SGLang's ``TritonAttnBackend`` whose ``kv_indices`` never contain DEAD (eager and
        CUDA-graph replay paths alike: both fill the metadata through
        ``_fill_kv_indptr_and_indices``)."""

        def _fill_kv_indptr_and_indices(self, bs, seq_lens, req_pool_indices, kv_indices):
            kv_indptr = super()._fill_kv_indptr_and_indices(
                bs, seq_lens, req_pool_indices, kv_indices
            )
            if HOLEY.count > 0 and HOLEY.dead_slot is not None:
                bound = bs * self.req_to_token.shape[1]  # >= the batch's entries, host-known
                drop_dead_kv_indices(kv_indptr, kv_indices[:bound], HOLEY.dead_slot)
            return kv_indptr

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            o = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            if OBSERVING:
                observe_extend(self, q, layer, forward_batch)
            return o

    return AgentKVTritonBackend


def create_agentkv_backend(runner):
    """The factory registered with ``register_attention_backend("agentkv")``; also hooks the
    model's decoder layers for KVzap (:mod:`.hidden_states`: SGLang builds the attention
    backend after loading the model)."""
    model = getattr(runner, "model", None)
    if model is not None:
        install_hidden_state_hooks(model)
    return make_backend_class()(runner)
