"""agentkv as an SGLang plugin: eviction policies on SGLang's own pools and radix cache, no fork.

Install agentkv next to SGLang 0.5.17 and start SGLang with the plugin enabled::

    SGLANG_PLUGINS=agentkv python -m sglang.launch_server --model-path ... \\
        --attention-backend agentkv --radix-cache-backend agentkv --page-size 1

(``agentkv serve --engine sglang ...`` does the same). SGLang's ``load_plugins()`` finds the
entry point ``agentkv = agentkv.integrations.sglang:register`` in the group
``sglang.srt.plugins`` and calls :func:`register` in every SGLang process, which

- registers the attention backend ``agentkv`` (SGLang's Triton backend with DEAD dropped from
  ``kv_indices``, feeding prefill observers; :mod:`.attention`); its factory puts a
  ``forward_pre_hook`` on each decoder layer, handing KVzap the layer inputs
  (:mod:`.hidden_states`, :mod:`.decode_pruning`),
- registers the radix-cache backend ``agentkv`` (hole-preserving session namespaces,
  reference-counted frees on a reserved DEAD slot; :mod:`.radix_cache`, :mod:`.slot_refcounts`),
- hooks ``OpenAIServingChat._convert_to_internal_request`` (AFTER: validate the payload, tag the
  prompt) and ``Scheduler.run_batch`` (AROUND: observe, then plan after prefill, releasing
  SGLang's ``batch_is_full`` where the plans freed slots, and after eager decode steps for
  KVzap's ``decode_interval``; :mod:`.runtime`),
- hooks ``OpenAIServingChat._build_chat_response`` (AFTER), ``_generate_stream_content`` and
  ``_generate_chat_stream`` (AROUND): ``usage.agentkv`` in chat responses, streamed too
  (:mod:`.usage`).

Pinned to SGLang 0.5.17: the newest release whose torch pin (2.11) matches the GPU machine the
project tests on; the hooked names (``Scheduler.run_batch``,
``OpenAIServingChat._convert_to_internal_request`` / ``_build_chat_response`` /
``_generate_stream_content`` / ``_generate_chat_stream``, ``TritonAttnBackend.
_fill_kv_indptr_and_indices``, ``RadixCache`` internals, ``Req.customized_info``) are SGLang
internals, so another version needs the tests in ``tests/integrations/sglang`` run against it
first.
"""

from __future__ import annotations

import logging

SGLANG_VERSION = "0.5.17"
BACKEND = "agentkv"

logger = logging.getLogger("agentkv.sglang")

_registered = False


def register() -> None:
    """The plugin entry point (``sglang.srt.plugins``): register backends and hooks."""
    global _registered
    if _registered:
        return
    _registered = True
    import sglang
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.mem_cache.registry import register_radix_cache_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import add_attention_backend_choices

    if sglang.__version__ != SGLANG_VERSION:
        logger.warning(
            "agentkv's SGLang plugin is tested with SGLang %s, this is %s",
            SGLANG_VERSION,
            sglang.__version__,
        )

    from agentkv.integrations.sglang.attention import create_agentkv_backend
    from agentkv.integrations.sglang.runtime import run_batch, tag_chat_request
    from agentkv.integrations.sglang.usage import (
        add_usage_to_response,
        add_usage_to_stream,
        watch_stream_content,
    )

    register_attention_backend(BACKEND)(create_agentkv_backend)
    add_attention_backend_choices([BACKEND])
    register_radix_cache_backend(BACKEND, create_radix_cache)
    HookRegistry.register(
        "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._convert_to_internal_request",
        tag_chat_request,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.run_batch", run_batch, HookType.AROUND
    )
    chat = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat"
    HookRegistry.register(f"{chat}._build_chat_response", add_usage_to_response, HookType.AFTER)
    HookRegistry.register(f"{chat}._generate_stream_content", watch_stream_content, HookType.AROUND)
    HookRegistry.register(f"{chat}._generate_chat_stream", add_usage_to_stream, HookType.AROUND)
    logger.info("agentkv SGLang plugin registered (attention and radix-cache backend %r)", BACKEND)


def create_radix_cache(ctx):
    """Factory for ``register_radix_cache_backend`` (``TreeCacheBuildContext`` -> cache)."""
    from agentkv.integrations.sglang.radix_cache import AgentKVRadixCache
    from agentkv.integrations.sglang.runtime import planner_methods

    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.enable_hierarchical_cache:
        raise ValueError(
            "--radix-cache-backend agentkv supports full-attention models without "
            "hierarchical cache"
        )
    return AgentKVRadixCache(ctx.params, methods=planner_methods(ctx))
