"""Every ```python block of README.md and docs/*.md runs as written.

Each block runs in a fresh interpreter (blocks are self-contained: no names from earlier
blocks). Blocks that talk to ``http://127.0.0.1:8000`` run against a real ``agentkv serve``
that this test starts on 127.0.0.1 (on a free port: the only change made to a block is that
port). A block may be skipped only by an HTML comment right above it, which must give the
reason::

    <!-- doc-test: skip (API signatures, not code) -->
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
AGENTKV = Path(sys.executable).parent / "agentkv"
SERVER = "127.0.0.1:8000"
SKIP = re.compile(r"<!--\s*doc-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->")
FENCE = re.compile(r"^```python[^\n]*\n(?P<code>.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    code: str
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    blocks = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip().splitlines()
        skip = SKIP.fullmatch(before[-1].strip()) if before else None
        line = text.count("\n", 0, m.start()) + 1
        blocks.append(Block(path, line, m["code"], skip["reason"] if skip else None))
    return blocks


BLOCKS = [b for path in DOCS for b in code_blocks(path)]


def test_blocks_found_and_skips_are_few() -> None:
    assert len(BLOCKS) >= 10
    skipped = [b.id for b in BLOCKS if b.skip]
    assert len(skipped) <= 4, skipped


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("AGENTKV_TEST_THREADS", "1")}


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    """``agentkv serve`` on a free port of 127.0.0.1 (CPU); yields ``127.0.0.1:PORT``."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("torch")
    port = _free_port()
    cmd = [str(AGENTKV), "serve", "--port", str(port), "--device", "cpu", "--kv-slots", "8192"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(), text=True
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"agentkv serve exited:\n{proc.stdout.read()}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "agentkv serve did not come up in 180 s"
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if block.skip:
        pytest.skip(block.skip)
    code = block.code
    if SERVER in code:
        code = code.replace(SERVER, request.getfixturevalue("served"))
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    res = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_env(),
        timeout=300,
    )
    assert res.returncode == 0, (
        f"{block.id} failed:\n{block.code}\n--- output ---\n{res.stdout}{res.stderr}"
    )
