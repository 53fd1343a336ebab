#!/usr/bin/env bash
# Download into .whl/ the small wheels agentkv needs on the lent GPU machine beside its
# torch / triton (pydantic and its dependencies, at this checkout's .venv versions, for the
# machine's CPython 3.12), plus any package named as an argument (e.g. gguf).
# Used by replay_device.sh and decode_grid_device.sh `prepare`; run here, needs PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
mkdir -p .whl
core=$($py -c "import pydantic_core; print(pydantic_core.__version__)")
pyd=$($py -c "import pydantic; print(pydantic.VERSION)")
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d .whl "pydantic==$pyd" "pydantic-core==$core" \
    annotated-types typing-inspection "typing-extensions>=4.16" "$@"
