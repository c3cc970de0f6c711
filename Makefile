# Two commands set everything up on a fresh machine (see README):
#   make train   trains examples/keras_train.py on 2 local workers (offline digits data)
#   make test    installs the system packages (as root), builds the four environments at once,
#                runs ruff, mypy and every test; the tests start their own Slurm cluster. It
#                ends with a table of where the time went (tools/timed.py; the figures are
#                kept in .test-times/).
# Nothing installed by hand is needed.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tfdist-installed
# JAX in .venv/ lives apart, on the path only of processes with KERAS_BACKEND=jax
# (tools/jax_apart.py): TensorFlow imports JAX at start-up wherever it can, 1.4 s of each of the
# tests' TensorFlow processes.
JAX_DIR := $(VENV)/jax
# Horovod's environment: TensorFlow 2.18.1, the newest Horovod 0.28.1 builds against.
HVD_VENV := .venv-horovod
HVD_STAMP := $(HVD_VENV)/.tfdist-installed
# The TensorFlow 2.15 lane: TensorFlow 2.15.1 (tf.keras is Keras 2); no Horovod (see TF215_TESTS).
TF215_VENV := .venv-tf215
TF215_STAMP := $(TF215_VENV)/.tfdist-installed
# The TensorFlow 2.22 lane: its release candidate as the full wheel, with the Keras it requires.
TF222_VENV := .venv-tf222
TF222_STAMP := $(TF222_VENV)/.tfdist-installed
MODEL_DIR ?= runs/keras_train
# Each step of `make test` and of the environments' builds is timed into $(TIMES).
TIMES := .test-times
TIMED := $(PYTHON) tools/timed.py run $(TIMES)
# The test processes of each pytest run: two (pytest-xdist; tests/parallel.py says which tests
# stay together). Most tests are real worker processes that spend part of their time waiting.
# `make test XDIST=` runs one. Two multi-process tests at once once made a rank miss
# TensorFlow's 10 s heartbeat; tfdist's heartbeat timeout is 30 s (TFDIST_HEARTBEAT_TIMEOUT).
XDIST ?= -n 2 --dist loadgroup
# The editable installs of tfdist write tfdist.egg-info in the checkout: one at a time.
EDITABLE_LOCK := flock $(CURDIR)/.editable.lock

.PHONY: system venv venv-horovod venv-tf215 venv-tf222 envs train test test-full test-steps lint clean

system:
	bash tools/system-packages.sh

venv: $(STAMP)

$(STAMP): requirements/bootstrap.txt requirements/test.txt requirements/no-deps.txt \
		requirements/torch.txt requirements/deepspeed.txt requirements/jax.txt setup.cfg
	$(TIMED) $(VENV) -- bash -c 'test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)'
	$(TIMED) $(VENV) -- $(BIN)/python -m pip install --quiet --disable-pip-version-check \
		-r requirements/bootstrap.txt
	$(TIMED) $(VENV) -- $(BIN)/pip install --quiet -r requirements/test.txt
	$(TIMED) $(VENV) -- $(BIN)/pip install --quiet --no-deps -r requirements/no-deps.txt
	$(TIMED) $(VENV) -- $(BIN)/pip install --quiet --no-deps -r requirements/torch.txt
	$(TIMED) $(VENV) -- $(BIN)/pip install --quiet --no-deps --upgrade --target $(JAX_DIR) \
		-r requirements/jax.txt
	$(BIN)/python tools/jax_apart.py $(JAX_DIR)
	$(TIMED) $(VENV) -- env DS_BUILD_OPS=0 $(BIN)/pip install --quiet --no-deps \
		-r requirements/deepspeed.txt
	$(TIMED) $(VENV) -- $(EDITABLE_LOCK) $(BIN)/pip install --quiet --no-deps \
		--no-build-isolation -e .
	touch $@

venv-horovod: $(HVD_STAMP)

$(HVD_STAMP): tools/horovod-env.sh requirements/bootstrap.txt requirements/horovod.txt \
		requirements/horovod-no-deps.txt requirements/torch.txt setup.cfg | system
	$(TIMED) $(HVD_VENV) -- bash tools/horovod-env.sh $(HVD_VENV) $(PYTHON) horovod

venv-tf215: $(TF215_STAMP)

$(TF215_STAMP): requirements/bootstrap.txt requirements/tf215.txt requirements/tf215-no-deps.txt \
		setup.cfg
	$(TIMED) $(TF215_VENV) -- bash -c 'test -x $(TF215_VENV)/bin/python || $(PYTHON) -m venv $(TF215_VENV)'
	$(TIMED) $(TF215_VENV) -- $(TF215_VENV)/bin/python -m pip install --quiet \
		--disable-pip-version-check -r requirements/bootstrap.txt
	$(TIMED) $(TF215_VENV) -- $(TF215_VENV)/bin/pip install --quiet -r requirements/tf215.txt
	$(TIMED) $(TF215_VENV) -- $(TF215_VENV)/bin/pip install --quiet --no-deps \
		-r requirements/tf215-no-deps.txt
	$(TIMED) $(TF215_VENV) -- $(EDITABLE_LOCK) $(TF215_VENV)/bin/pip install --quiet --no-deps \
		--no-build-isolation -e .
	touch $@

venv-tf222: $(TF222_STAMP)

$(TF222_STAMP): requirements/bootstrap.txt requirements/tf222.txt setup.cfg
	$(TIMED) $(TF222_VENV) -- bash -c 'test -x $(TF222_VENV)/bin/python || $(PYTHON) -m venv $(TF222_VENV)'
	$(TIMED) $(TF222_VENV) -- $(TF222_VENV)/bin/python -m pip install --quiet \
		--disable-pip-version-check -r requirements/bootstrap.txt
	$(TIMED) $(TF222_VENV) -- $(TF222_VENV)/bin/pip install --quiet -r requirements/tf222.txt
	$(TIMED) $(TF222_VENV) -- $(EDITABLE_LOCK) $(TF222_VENV)/bin/pip install --quiet --no-deps \
		--no-build-isolation -e .
	touch $@

train: $(STAMP)
	$(BIN)/tfdist launch -n 2 examples/keras_train.py --epochs=8 --batch_size=64 \
		--scale_lr --model_dir=$(MODEL_DIR) --data_dir=$(CURDIR)/.cache/tensorflow_datasets

# The TensorFlow 2.15 lane runs what differs on Keras 2 as tf.keras, one test of each kind (the
# main run tests every case on tf_keras 2.21 and, under Horovod, 2.18: the same Keras 2): fit
# and custom loops on several workers, the Keras features and numbers against one process
# (MWMS: only here on Keras 2, tests/test_keras_traps.py says why), the replica sync check, resume after a stop (fit on MWMS after a
# signal with Keras 2's legacy random ops, a custom loop after a signal),
# several replicas in one process, the digits example, and tfdist's Slurm resolver, which
# subclasses TensorFlow's, against TensorFlow 2.15's own (test_resolver.py, in one process: the
# rendered jobs on the Slurm test cluster run in the main run). Its tf_keras cases are
# left out (-k): tf_keras 2.15 is the same Keras 2 as its keras 2.15. No Horovod here: its own
# compile against TensorFlow 2.15 cost a fresh machine about 4 minutes of CI's 40; Horovod on
# Keras 2 is tested in the main run (tf_keras 2.18), on TensorFlow 2.15 it was last run on
# 2026-11-26 (docs/versions.md). The scaling chart is drawn here too: this lane's environment has
# matplotlib, the main one leaves it out (with scikit-learn) because Keras 3 imports both at
# start-up when they are installed, 2.3 s of every TensorFlow process's 7.9 s import on one core.
TF215_TESTS := tests/test_keras_compat.py tests/test_keras_traps.py tests/test_quiet.py \
	"tests/test_preemption.py::test_a_custom_loop_resumes_at_the_agreed_step_bit_identical[mwms-keras3]" \
	tests/test_preemption.py::test_the_control_keras2_dropout_on_legacy_random_ops_resumes_with_other_masks \
	tests/test_mirrored.py::test_auto_mirrors_one_process_over_its_devices \
	tests/test_mirrored.py::test_two_replicas_train_as_one_with_the_same_global_batch \
	tests/test_resolver.py \
	tests/test_scaling.py::test_the_plot_draws_the_reports_points
TF215_SELECT := not tf_keras and not horovod
# The lane's part of `make test-full` only: the bit-identical 2-worker runs, the sync check and
# the example from a flagfile, whose TensorFlow 2.15 collectives and training the Keras-traps
# launch and the preemption cases above run too; the walltime guard (its stop is a signal's,
# which tf_keras's fit takes in the main run and the custom loop above here; it waits most of
# its 69 s); and fit's resume after a hard kill from an epoch's end (45 s: the dropout control
# above stops and resumes fit on Keras 2.15, every step once; the main run resumes tf_keras's
# fit bit-identical after a hard kill).
TF215_FULL_TESTS := tests/test_multiworker.py tests/test_sync.py \
	tests/test_examples.py::test_two_workers_train_the_digits_from_a_flagfile \
	"tests/test_preemption.py::test_the_walltime_guard_saves_in_time_with_no_signal_and_the_next_run_resumes[mwms-keras3]" \
	"tests/test_preemption.py::test_a_hard_kill_loses_at_most_the_safety_interval_and_the_resume_is_exact[epoch-end-mwms-keras3]"

# The TensorFlow 2.22 lane (the release candidate; the release when it is out): the example on
# 2 workers and the tests of what a TensorFlow or Keras release changes: the Keras internals
# tfdist patches (test_keras_compat.py, and the Keras-traps launch against one process), the
# start-up lines it hides (test_quiet.py) and the resolver (test_resolver.py).
TF222_TESTS := tests/test_keras_compat.py tests/test_quiet.py tests/test_resolver.py \
	tests/test_examples.py::test_two_workers_train_the_digits_from_a_flagfile
TF222_SELECT := not tf_keras and not horovod

# The four environments at once: their pip installs overlap the Horovod compile.
envs:
	$(MAKE) --no-print-directory -j4 venv venv-horovod venv-tf215 venv-tf222

# make test: the steps below, then the table of their times (also when a step failed).
test:
	@rm -rf $(TIMES)
	@$(MAKE) --no-print-directory test-steps; status=$$?; \
		$(PYTHON) tools/timed.py report $(TIMES); exit $$status

# make test-full: make test with every combination the tests leave to the full matrix
# (tests/helpers.py, FULL_MATRIX), the long soak (20 preemptions) and the TensorFlow 2.15 lane's
# whole list: about twice make test's time.
test-full:
	TFDIST_TEST_MATRIX=full TFDIST_TEST_SOAK_CYCLES=20 $(MAKE) --no-print-directory test \
		TF215_TESTS='$(TF215_TESTS) $(TF215_FULL_TESTS)'

test-steps:
	$(TIMED) system -- bash tools/system-packages.sh
	$(MAKE) --no-print-directory envs
	$(TIMED) lint -- $(MAKE) --no-print-directory lint
	$(TIMED) "pytest $(VENV)" -- $(BIN)/python -m pytest $(XDIST) --junitxml=$(TIMES)/venv.xml
	$(TIMED) "pytest $(TF215_VENV)" -- $(TF215_VENV)/bin/python -m pytest $(XDIST) \
		--junitxml=$(TIMES)/venv-tf215.xml -k '$(TF215_SELECT)' $(TF215_TESTS)
	$(TIMED) "pytest $(TF222_VENV)" -- $(TF222_VENV)/bin/python -m pytest $(XDIST) \
		--junitxml=$(TIMES)/venv-tf222.xml -k '$(TF222_SELECT)' $(TF222_TESTS)

lint: $(STAMP)
	$(BIN)/ruff check tfdist examples tests benchmarks
	KERAS_BACKEND=jax $(BIN)/mypy tfdist  # JAX on its path: its types (tools/jax_apart.py)
	bash tools/shellcheck.sh

clean:
	rm -rf $(VENV) $(HVD_VENV) $(TF215_VENV) $(TF222_VENV) runs .cache .pytest_cache .mypy_cache .ruff_cache \
		$(TIMES) .editable.lock
