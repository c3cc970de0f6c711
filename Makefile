# Two commands set everything up on a fresh machine (see README):
#   make train   trains examples/keras_train.py on 2 local workers (offline digits data)
#   make test    runs ruff, mypy and every test
# Both build .venv/ first from the pinned requirements; nothing installed by hand is needed.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tfdist-installed
MODEL_DIR ?= runs/keras_train

.PHONY: venv train test lint clean

venv: $(STAMP)

$(STAMP): requirements/bootstrap.txt requirements/test.txt requirements/no-deps.txt setup.cfg
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements/bootstrap.txt
	$(BIN)/pip install --quiet -r requirements/test.txt
	$(BIN)/pip install --quiet --no-deps -r requirements/no-deps.txt
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

train: $(STAMP)
	$(BIN)/tfdist launch -n 2 examples/keras_train.py --epochs=8 --batch_size=64 \
		--scale_lr --model_dir=$(MODEL_DIR) --data_dir=$(CURDIR)/.cache/tensorflow_datasets

test: lint
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check tfdist examples tests benchmarks
	$(BIN)/mypy tfdist

clean:
	rm -rf $(VENV) runs .cache .pytest_cache .mypy_cache .ruff_cache
