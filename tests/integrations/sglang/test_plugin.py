"""The entry point under SGLang's own ``load_plugins()`` (a fresh interpreter each: plugins
load once per process and patch SGLang's classes)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    """
    import torch
    for op in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES
    print("attention", "agentkv" in ATTENTION_BACKENDS, "agentkv" in ATTENTION_BACKEND_CHOICES)
    print("radix", "agentkv" in registered_radix_cache_backends())
    def hooked(fn):
        cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())]
        return any(getattr(c, "__module__", "").startswith("agentkv.") for c in cells)
    print("run_batch", hooked(Scheduler.run_batch))
    print("chat", hooked(OpenAIServingChat._convert_to_internal_request))
    print("usage", all(hooked(getattr(OpenAIServingChat, m)) for m in (
        "_build_chat_response", "_generate_stream_content", "_generate_chat_stream")))
    """
)


def probe(plugins: str | None) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("SGLANG_PLUGINS", None)
    if plugins is not None:
        env["SGLANG_PLUGINS"] = plugins
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_load_plugins_registers_the_agentkv_backends_and_hooks():
    out = probe("agentkv")
    assert "attention True True" in out
    assert "radix True" in out
    assert "run_batch True" in out
    assert "chat True" in out
    assert "usage True" in out


def test_sglang_plugins_whitelist_leaves_sglang_stock():
    out = probe("someone-else")
    assert "attention False False" in out
    assert "radix False" in out
    assert "run_batch False" in out
    assert "chat False" in out
    assert "usage False" in out
