"""``agentkv serve --engine sglang``: the SGLang command line with the plugin enabled."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentkv.engine.cli import app
from agentkv.engine.sglang_launch import sglang_command


def test_command_enables_the_plugin_and_passes_server_args_through():
    argv, env = sglang_command(
        "/models/qwen3", "0.0.0.0", 30000, "k1", ["--tp", "2", "--page-size", "1"], env={}
    )
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    line = " ".join(argv)
    assert "--model-path /models/qwen3 --host 0.0.0.0 --port 30000 --api-key k1" in line
    assert "--attention-backend agentkv" in line and "--radix-cache-backend agentkv" in line
    assert argv.count("--page-size") == 1  # the user's own flag, not twice
    assert argv[-4:] == ["--tp", "2", "--page-size", "1"]
    assert env["SGLANG_PLUGINS"] == "agentkv"


def test_plugin_whitelist_is_extended_not_replaced():
    _, env = sglang_command("m", "h", 1, env={"SGLANG_PLUGINS": "other"})
    assert env["SGLANG_PLUGINS"] == "other,agentkv"
    _, env = sglang_command("m", "h", 1, env={"SGLANG_PLUGINS": "agentkv, other"})
    assert env["SGLANG_PLUGINS"] == "agentkv,other"
    argv, _ = sglang_command("m", "h", 1, extra=["--attention-backend=triton"], env={})
    assert "--attention-backend" not in argv  # the user chose another backend


def test_cli_dry_run_prints_the_command():
    r = CliRunner().invoke(
        app,
        [
            "serve",
            "--engine",
            "sglang",
            "--model",
            "/m",
            "--port",
            "30001",
            "--dry-run",
            "--",
            "--mem-fraction-static",
            "0.8",
        ],
    )
    assert r.exit_code == 0, r.output
    assert r.output.startswith("SGLANG_PLUGINS=agentkv ")
    assert "sglang.launch_server --model-path /m" in r.output
    assert r.output.rstrip().endswith("--mem-fraction-static 0.8")


def test_cli_rejects_what_it_cannot_serve():
    r = CliRunner().invoke(app, ["serve", "--engine", "sglang", "--dry-run"])
    assert r.exit_code == 2 and "--model" in r.output
    r = CliRunner().invoke(app, ["serve", "--engine", "vllm"])
    assert r.exit_code == 2 and "--engine" in r.output
    r = CliRunner().invoke(app, ["serve", "--no-such-flag"])
    assert r.exit_code == 2 and "--no-such-flag" in r.output
    r = CliRunner().invoke(
        app, ["serve", "--engine", "sglang", "--model", "m", "--api-key", "a", "--api-key", "b"]
    )
    assert r.exit_code == 2 and "--api-key" in r.output


def _sglang_installed() -> bool:
    spec = importlib.util.find_spec("sglang")
    return spec is not None and spec.origin is not None


@pytest.mark.skipif(_sglang_installed(), reason="would start a server")
def test_cli_execs_sglangs_launcher():
    """Without SGLang installed the exec'd interpreter says so: the process really became
    ``python -m sglang.launch_server``."""
    agentkv = Path(sys.executable).parent / "agentkv"
    out = subprocess.run(
        [str(agentkv), "serve", "--engine", "sglang", "--model", "/nowhere", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "SGLANG_PLUGINS=agentkv" in out.stderr
    assert "No module named 'sglang'" in out.stderr
