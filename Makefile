# Make targets are the interface: CI calls the same targets a person does.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROTOS := $(wildcard proto/moe/*/v1/*.proto)
STAMP := $(VENV)/.installed

.PHONY: install gen-proto lint test test-unit test-integration demo clean bench-predict bench-io bench-replay bench-e2e bench

install: $(STAMP) gen/.stamp

# The native core (csrc/): `make native` builds build/native/expertcache_native*.so.
include csrc/native.mk
$(NATIVE_OBJS): | $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@# Generated protobuf code lives in gen/ (ignored by git); put it on the venv's path.
	$(PY) -c "import sysconfig, pathlib; pathlib.Path(sysconfig.get_paths()['purelib'], 'expertcache_gen.pth').write_text(str(pathlib.Path('gen').resolve()) + '\n')"
	@touch $@

gen-proto: gen/.stamp

gen/.stamp: $(PROTOS) $(STAMP)
	rm -rf gen && mkdir -p gen
	$(PY) -m grpc_tools.protoc -Iproto --python_out=gen --pyi_out=gen --grpc_python_out=gen $(PROTOS)
	@for d in $$(find gen -type d); do touch $$d/__init__.py; done
	@touch $@

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: install native lint
	$(VENV)/bin/pytest -q tests

test-unit: install
	$(VENV)/bin/pytest -q tests/unit

test-integration: install
	$(VENV)/bin/pytest -q tests/integration

# MODEL=path runs a real checkpoint directory instead of the built-in tiny one.
demo: install
	$(PY) -m expertcache.demo $(if $(MODEL),--model $(MODEL),)

clean:
	rm -rf gen build demo-data .pytest_cache .ruff_cache

# Predictor quality (eamc / history / combined precision & recall) on the shared gpt-oss trace,
# and the EAMC matching cost at 1 K / 10 K entries: prints them, writes bench/results/predict.json.
bench-predict: install
	$(PY) -m bench.predict_bench $(BENCH_PREDICT_ARGS)

# Store I/O: raw O_DIRECT vs the native Reader vs safetensors on a ~1.5 GiB store (built once under
# bench/.data/), and the cost of a cache-hit acquire+release; writes bench/results/io.json.
bench-io: install native
	$(PY) -m bench.io_bench $(BENCH_IO_ARGS)

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
BENCH_E2E_PRECISION ?= mxfp4
bench-e2e: install native
	$(PY) -m bench.e2e --precision bf16 --out bench/results/e2e-bf16.json $(BENCH_E2E_ARGS)
	$(PY) -m bench.e2e --precision $(BENCH_E2E_PRECISION) --compare-with bench/results/e2e-bf16.json $(BENCH_E2E_ARGS)

bench: bench-io bench-predict bench-replay bench-e2e
