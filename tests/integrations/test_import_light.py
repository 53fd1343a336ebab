"""The client side imports without torch, triton or transformers (checked in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "triton", "transformers")


def test_client_side_imports_without_heavy_deps() -> None:
    code = (
        "import json, sys\n"
        "import agentkv, agentkv.integrations.langgraph, agentkv.integrations.langchain\n"
        "import agentkv.integrations.openai, agentkv.integrations.kv_usage_callback\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
