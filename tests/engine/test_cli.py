"""``agentkv serve`` as a real subprocess: starts, serves one request, stops cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

AGENTKV = Path(sys.executable).parent / "agentkv"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("AGENTKV_TEST_THREADS", "1")}


def test_serve_subprocess():
    httpx = pytest.importorskip("httpx")
    openai = pytest.importorskip("openai")
    assert AGENTKV.is_file(), f"console script missing: {AGENTKV}"
    port = free_port()
    cmd = [str(AGENTKV), "serve", "--port", str(port), "--kv-slots", "2048", "--device", "cpu"]
    cmd += ["--no-cuda-graphs", "--no-fused-ops"]  # (what a user opts out with; not on a CPU)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=cli_env(), text=True
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"agentkv serve exited early:\n{proc.stdout.read()}"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "agentkv serve did not come up in 180 s"
            time.sleep(0.5)
        with openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
            resp = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
            )
        assert resp.choices[0].message.content
        assert resp.usage.model_dump()["agentkv"]["method"] == "full"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out
    assert f"127.0.0.1:{port}" in out  # uvicorn's startup line
    # agentkv's own start-up line and one log line per request
    assert "agentkv serve: model SmolLM2-135M-Instruct on cpu" in out
    assert "KV pool 2048 tokens" in out and f"serving http://127.0.0.1:{port}/v1" in out
    assert "decode on dense, policies" in out  # (the CPU's decode path, no graphs)
    assert "node=- policy=full()" in out


def test_serve_help_explains_policies():
    res = subprocess.run(
        [str(AGENTKV), "serve", "--help"],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=120,
    )
    assert res.returncode == 0
    assert "spec string" in res.stdout and "h2o:budget=32" in res.stdout
    assert "/v1/agentkv/capabilities" in res.stdout
    assert "--no-cuda-graphs" in res.stdout and "--no-fused-ops" in res.stdout


def test_serve_rejects_a_missing_model_dir(tmp_path):
    """In this process, through the same typer app: it exits before any server starts, so an
    interpreter's start-up is saved (the console script failing to start, exit code 2 and
    this message in its output: tests/examples/test_browsing.py's
    test_demo_server_reports_a_serve_that_fails_to_start)."""
    from typer.testing import CliRunner

    from agentkv.engine.cli import app

    args = ["serve", "--model", str(tmp_path / "nope"), "--port", str(free_port())]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2
    assert "not a HF model directory" in res.stderr
    assert isinstance(res.exception, SystemExit)  # a clean exit: no traceback
    assert "Traceback" not in res.output
