"""``agentkv serve --engine sglang``: the SGLang server command line with the agentkv plugin on.

Builds ``python -m sglang.launch_server`` with ``SGLANG_PLUGINS`` naming ``agentkv`` (SGLang's
plugin whitelist; the plugin is the ``sglang.srt.plugins`` entry point of this package) and
the flags the plugin needs; every other SGLang server argument passes through unchanged.
Nothing here imports SGLang (stdlib only).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

PLUGIN = "agentkv"

#: flags the plugin needs, unless the user passed the flag itself.
PLUGIN_FLAGS: dict[str, str] = {
    "--attention-backend": PLUGIN,
    "--radix-cache-backend": PLUGIN,
    "--page-size": "1",
}


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def sglang_command(
    model: str,
    host: str,
    port: int,
    api_key: str | None = None,
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    python: str = sys.executable,
) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` that start SGLang's server on ``model`` with the agentkv plugin.

    ``extra``: SGLang server arguments, passed through (``--tp 2``, ``--mem-fraction-static
    0.8``, ...); a plugin flag given there wins over the default. ``env``: the environment
    to extend (default ``os.environ``); ``SGLANG_PLUGINS`` gets ``agentkv`` added (kept if a
    whitelist already names it)."""
    argv = [python, "-m", "sglang.launch_server", "--model-path", model]
    argv += ["--host", host, "--port", str(port)]
    if api_key:
        argv += ["--api-key", api_key]
    for flag, value in PLUGIN_FLAGS.items():
        if not _has_flag(extra, flag):
            argv += [flag, value]
    argv += list(extra)
    out = dict(os.environ if env is None else env)
    plugins = [p.strip() for p in out.get("SGLANG_PLUGINS", "").split(",") if p.strip()]
    if PLUGIN not in plugins:
        plugins.append(PLUGIN)
    out["SGLANG_PLUGINS"] = ",".join(plugins)
    return argv, out
