# Two commands do all set-up: `make train` and `make test`. Each (re)builds .venv from
# pyproject.toml when it is missing or older than pyproject.toml.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/default
CONFIG ?= configs/default.py

.PHONY: train test lint format bench docs multi30k clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,test]'
	touch $@

train: $(VENV)/.installed
	$(PY) train.py --config $(CONFIG) --workdir $(WORKDIR)

test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest tests -q -n 2 --durations=10

# ruff, then import-linter's contracts in pyproject.toml: subpackages import only downward, and
# no modules import each other in a circle.
lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports

format: $(VENV)/.installed
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) bench/run.py $(BENCH_ARGS)

# The documentation site (docs/, MyST Markdown + autodoc): every warning is an error.
docs: $(VENV)/.installed
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

# Multi30k En-De (docs/results.md): train, then BLEU on test2016 with the config's beam and alpha.
M30K_DATA ?= ../shared/data/multi30k
M30K_WORKDIR ?= runs/m30k
multi30k: $(VENV)/.installed
	$(PY) train.py --config configs/multi30k.py --config.data_dir=$(M30K_DATA) --workdir $(M30K_WORKDIR)
	$(PY) -m flaxformer_lite.cli.evaluate --workdir $(M30K_WORKDIR) \
		--source $(M30K_DATA)/test2016.en --reference $(M30K_DATA)/test2016.de \
		--output $(M30K_WORKDIR)/test2016.hyp --report $(M30K_WORKDIR)/test2016.json

clean:
	rm -rf $(VENV) runs docs/_build
