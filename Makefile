# Two commands set everything up on a fresh machine (see README):
#   make train   trains examples/keras_train.py on 2 local workers (offline digits data)
#   make test    installs the system packages (as root), builds both environments, runs ruff,
#                mypy and every test; the tests start their own Slurm cluster.
# Nothing installed by hand is needed.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tfdist-installed
# Horovod's environment: TensorFlow 2.18.1, the newest Horovod 0.28.1 builds against.
HVD_VENV := .venv-horovod
HVD_STAMP := $(HVD_VENV)/.tfdist-installed
MODEL_DIR ?= runs/keras_train

.PHONY: system venv venv-horovod train test lint clean

system:
	bash tools/system-packages.sh

venv: $(STAMP)

$(STAMP): requirements/bootstrap.txt requirements/test.txt requirements/no-deps.txt \
		requirements/torch.txt requirements/deepspeed.txt setup.cfg
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements/bootstrap.txt
	$(BIN)/pip install --quiet -r requirements/test.txt
	$(BIN)/pip install --quiet --no-deps -r requirements/no-deps.txt
	$(BIN)/pip install --quiet --no-deps -r requirements/torch.txt
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet --no-deps -r requirements/deepspeed.txt
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

venv-horovod: $(HVD_STAMP)

$(HVD_STAMP): tools/horovod-env.sh requirements/bootstrap.txt requirements/horovod.txt \
		requirements/horovod-no-deps.txt requirements/torch.txt setup.cfg
	$(MAKE) system
	bash tools/horovod-env.sh $(HVD_VENV) $(PYTHON)

train: $(STAMP)
	$(BIN)/tfdist launch -n 2 examples/keras_train.py --epochs=8 --batch_size=64 \
		--scale_lr --model_dir=$(MODEL_DIR) --data_dir=$(CURDIR)/.cache/tensorflow_datasets

test: system lint $(HVD_STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check tfdist examples tests benchmarks
	$(BIN)/mypy tfdist
	bash tools/shellcheck.sh

clean:
	rm -rf $(VENV) $(HVD_VENV) runs .cache .pytest_cache .mypy_cache .ruff_cache
