# tierfs: `make demo` and `make test` set everything up themselves on a fresh
# Debian machine (Debian packages, a venv, the project), then run.

VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
DEB     := fuse3 libfuse3-dev pkg-config gcc
PYTEST_ARGS ?=

.PHONY: all demo test deps setup lint bench clean

all: test

# Debian packages (pyfuse3 builds against libfuse3; fusermount3 unmounts).
deps:
	@missing=""; \
	for p in $(DEB); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	python3 -c 'import ensurepip' 2>/dev/null || missing="$$missing python3-venv"; \
	python3 -c 'import sysconfig,os,sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"],"Python.h")))' \
	  || missing="$$missing python3-dev"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing </dev/null; \
	fi

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: deps $(STAMP)

demo: setup
	$(PY) scripts/demo.py

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check tierfs tests bench scripts

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
