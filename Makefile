# openpretrain — every target sets up what it needs (.venv), so each works on a fresh clone.
#   make report   regenerate outputs/<preset>/ (PRESET=tiny by default; settings.ini holds the defaults)
#   make test     notebook tests (nbdev-test, #| slow cells skipped) + pytest (slow marker skipped)
#   make bench    benchmarks (ratios against a reference measured in the same run; not run in CI)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PRESET ?=
# CPU torch where no NVIDIA GPU is visible (that wheel is on the dev/CI machines' disk); a CUDA build elsewhere.
TORCH := $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)
EXTRAS := dev,tokenizers,toxicity
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export HF_DATASETS_OFFLINE := 1
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv report report-check pages test test-slow chromium check-sync bench bench-gpu lint data tokenizers toxicity-heads clean

# The environment: rebuilt only when pyproject.toml changes (the stamp records the install).
$(VENV)/.stamp: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@
venv: $(VENV)/.stamp

report: venv
	-$(MAKE) --no-print-directory tokenizers
	$(BIN)/openpretrain report $(if $(PRESET),--preset $(PRESET))

# Re-render pages/, index.html and the claims ledger of an existing outputs/<preset>/ without running a chapter.
pages: venv
	$(BIN)/openpretrain report --pages $(if $(PRESET),--preset $(PRESET))

# Rerun the report into a scratch folder and compare every table and figure with the committed manifest (exit 1 on a
# difference, naming the files): two runs of one commit must agree bit for bit.
report-check: venv
	-$(MAKE) --no-print-directory tokenizers
	$(BIN)/openpretrain report --check $(if $(PRESET),--preset $(PRESET))

# Notebook tests write their artifacts to a scratch folder, never over the committed outputs/tiny.
test: venv
	OPENPRETRAIN_OUTPUTS=$$(mktemp -d) OMP_NUM_THREADS=1 $(BIN)/nbdev-test --n-workers 2 --timing --cell-timing-min 5
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -n 2 --durations=10

# The slow robots test compares with protego 0.6 itself: its wheel is fetched once (from the package registry).
# The browser test screenshots the rendered report with Debian's chromium (build/test-artifacts/screenshots/).
test-slow: venv chromium
	test -f .cache/wheels/protego-0.6.2-py3-none-any.whl || $(BIN)/pip download -q protego==0.6.2 --no-deps -d .cache/wheels
	OPENPRETRAIN_OUTPUTS=$$(mktemp -d) $(BIN)/nbdev-test --flags slow --n-workers 2
	$(BIN)/pytest -q -m slow

# Headless Chromium for the slow browser test of the rendered report, from Debian when it is not on PATH.
chromium:
	command -v chromium >/dev/null || { apt-get update && apt-get install -y chromium; }

# CI: the notebooks are the source of lib/, so exporting and cleaning them must change nothing.
check-sync: venv
	$(BIN)/nbdev-export
	$(BIN)/nbdev-clean
	git status --porcelain -- lib nbs | tee /dev/stderr | (! grep -q .) \
	  || { echo "lib/ or nbs/ changed after nbdev-export/nbdev-clean: export, clean and commit"; exit 1; }

bench: venv
	for b in benchmarks/bench_*.py; do echo "== $$b"; OMP_NUM_THREADS=2 $(BIN)/python $$b || exit 1; done

# One script for one GPU: bf16 MFU of a ~1B dense config and of the hybrid, Triton xIELU vs PyTorch.
bench-gpu: venv
	$(BIN)/python benchmarks/gpu.py

lint: venv
	$(BIN)/ruff check lib kernels tests benchmarks

# Rebuild data/ byte for byte from the pinned Debian and npm packages (needs apt-get, dpkg-deb, groff, npm, amd64;
# ~2 min). Downloads are cached in .cache/sources; a clean rebuild leaves `git status data/` empty.
data: venv
	apt-get update -qq
	$(BIN)/python -c "from openpretrain.tools.build import build_corpus; build_corpus()"
	git status --short data/

# Third-party vocabularies for chapter 05 (llama.cpp GGUF vocab files from the llama-cpp-python 0.3.36 sdist,
# ~77 MB download), converted and checked against their test vectors into .cache/tokenizers (not redistributed).
# Skipped when the cache is complete; Tekken, Qwen, cl100k and our BPEs work without it.
tokenizers: venv
	$(BIN)/python -c "from openpretrain.tokenization import fetch_tokenizers; print(fetch_tokenizers())"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# The committed toxicity heads (data/toxicity/heads.safetensors) from the committed weak labels; a report run never
# writes data/ (chapter 04 trains into .cache/toxicity/ and compares). Embeddings are cached in .cache/embeddings.
toxicity-heads: venv
	OMP_NUM_THREADS=1 $(BIN)/python -c "from openpretrain.compliance.toxicity import build_heads; print(build_heads('tiny', workers=2))"
	sha256sum data/toxicity/heads.safetensors
