# tierfs: `make demo` and `make test` set everything up themselves on a fresh
# Debian machine (Debian packages, a venv, the project), then run.

VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
ML_STAMP := $(VENV)/.ml-installed
DEB     := fuse3 libfuse3-dev pkg-config gcc rsync git
PYTEST_ARGS ?=
# Two workers (the suite's mounts and stores wait on each other more than they
# compute); worksteal: a worker left without tests takes the other's queue.
PYTEST_PAR ?= -n 2 --dist worksteal

.PHONY: all demo test deps peer-deps setup ml-deps lint bench clean install uninstall

# `make install` (as root): a self-contained venv under PREFIX, `tierfs` on the
# PATH, the mount(8) helper, the systemd unit and an example config.
PREFIX  ?= /opt/tierfs
BINDIR  ?= /usr/local/bin
SBINDIR ?= /sbin
UNITDIR ?= /etc/systemd/system
CONFDIR ?= /etc/tierfs
DOCDIR  ?= /usr/local/share/doc/tierfs

all: test

# Debian packages (pyfuse3 builds against libfuse3; fusermount3 unmounts; the
# tools tests run rsync and git on the mount).
deps:
	@extra=""; \
	python3 -c 'import ensurepip' 2>/dev/null || extra="python3-venv"; \
	python3 -c 'import sysconfig,os,sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"],"Python.h")))' \
	  || extra="$$extra python3-dev"; \
	sh scripts/apt-install.sh $(DEB) $$extra

# FUSE passthrough (third_party/README.md): pyfuse3 patched for it, built against
# a private libfuse 3.17 (cached in build/third_party). PASSTHROUGH=0: stock pyfuse3.
PASSTHROUGH   ?= 1
PYFUSE3_MODE  := $(if $(filter 0,$(PASSTHROUGH)),stock,passthrough)
PYFUSE3_STAMP := $(VENV)/.pyfuse3-$(PYFUSE3_MODE)

$(PYFUSE3_STAMP): third_party/build.sh third_party/pyfuse3/passthrough.patch
	test -x $(PY) || python3 -m venv $(VENV)
	rm -f $(VENV)/.pyfuse3-*
	sh third_party/build.sh $(VENV) $(PYFUSE3_MODE)
	touch $@

# The transfer engine's positioned GET writes (third_party/README.md): awscrt
# patched so the runtime writes a GET into a tier-1 file itself, built against
# the system's libcrypto (cached in build/third_party). AWSCRT_PATCH=0: stock awscrt.
AWSCRT_PATCH  ?= 1
AWSCRT_MODE   := $(if $(filter 0,$(AWSCRT_PATCH)),stock,patched)
AWSCRT_STAMP  := $(VENV)/.awscrt-$(AWSCRT_MODE)

$(AWSCRT_STAMP): third_party/awscrt/build.sh third_party/awscrt/recvfile.patch
	test -x $(PY) || python3 -m venv $(VENV)
	rm -f $(VENV)/.awscrt-*
	sh third_party/awscrt/build.sh $(VENV) $(AWSCRT_MODE)
	touch $@

$(STAMP): pyproject.toml $(PYFUSE3_STAMP) $(AWSCRT_STAMP)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: deps $(STAMP)

# tests/ml and bench/mlworkloads.py: PyTorch (CPU wheel: the extra pins torch==2.13.0
# exactly), safetensors, webdataset, matplotlib.
$(ML_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e '.[test,ml]'
	touch $(ML_STAMP)

ml-deps: setup $(ML_STAMP)

demo: setup
	$(PY) scripts/demo.py

# Then a representative subset of the mount tests again with FUSE passthrough
# off (TIERFS_TEST_PASSTHROUGH=0: every mount gets --no-passthrough, so the
# kernel write-back cache is on): the path of nodes without root, a 6.9 kernel
# or a passthrough build. (With PASSTHROUGH=0 the first pass is that path already.)
NO_PASSTHROUGH_TESTS ?= tests/integration/test_read_mount.py tests/integration/test_readpath.py \
	tests/integration/test_write_mount.py tests/integration/test_passthrough_mount.py
test: setup ml-deps
	$(PY) -m pytest -q $(PYTEST_PAR) $(PYTEST_ARGS)
	TIERFS_TEST_PASSTHROUGH=0 $(PY) -m pytest -q $(PYTEST_PAR) $(NO_PASSTHROUGH_TESTS)

# Benchmarks (root: they drop the page cache); JSON lands in bench/results/.
# PEERS=1 also installs rclone and s3fs (Debian packages) and measures them (--peers).
BENCH_RUNS ?= 3
BENCH_SIZE ?= 1G
PEERS   ?=
PEER_DEB := rclone s3fs
BENCH_ARGS = --size $(BENCH_SIZE) --runs $(BENCH_RUNS) $(if $(PEERS),--peers)
bench: setup ml-deps $(if $(PEERS),peer-deps)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/seqread.py $(BENCH_ARGS)
	$(PY) bench/randread.py $(BENCH_ARGS)
	$(PY) bench/herd.py $(BENCH_ARGS)
	$(PY) bench/ckptwrite.py $(BENCH_ARGS)
	$(PY) bench/modelload.py --size 1G --runs $(BENCH_RUNS) $(if $(PEERS),--peers)
	$(PY) bench/memory.py --size $(BENCH_SIZE) --runs 1
	$(PY) bench/mlworkloads.py --size 1G --runs $(BENCH_RUNS) $(if $(PEERS),--peers)

# After deps: s3fs depends on `fuse`, which fuse3 provides; installed first, fuse3 stays.
peer-deps: deps
	@sh scripts/apt-install.sh $(PEER_DEB)

lint: setup
	$(VENV)/bin/ruff check tierfs tests bench scripts
	$(VENV)/bin/mypy
	$(PY) scripts/import_graph.py tierfs

install: deps
	python3 -m venv $(PREFIX)
	$(PREFIX)/bin/pip install -q --upgrade pip
	sh third_party/build.sh $(PREFIX) $(PYFUSE3_MODE)
	sh third_party/awscrt/build.sh $(PREFIX) $(AWSCRT_MODE)
	$(PREFIX)/bin/pip install -q .
	install -d -m 0755 $(BINDIR) $(SBINDIR) $(UNITDIR) $(DOCDIR)
	install -d -m 0700 $(CONFDIR)
	ln -sf $(PREFIX)/bin/tierfs $(BINDIR)/tierfs
	ln -sf $(PREFIX)/bin/mount.tierfs $(SBINDIR)/mount.tierfs
	sed 's#/usr/local/bin/tierfs#$(BINDIR)/tierfs#g' 'systemd/tierfs@.service' > '$(UNITDIR)/tierfs@.service'
	chmod 0644 '$(UNITDIR)/tierfs@.service'
	install -m 0600 systemd/tierfs.example.toml $(CONFDIR)/example.toml.sample
	install -m 0644 README.md $(DOCDIR)/README.md
	install -d -m 0755 $(DOCDIR)/docs
	install -m 0644 docs/*.md $(DOCDIR)/docs/
	-systemctl daemon-reload 2>/dev/null
	@echo "installed: $(BINDIR)/tierfs, $(SBINDIR)/mount.tierfs, $(UNITDIR)/tierfs@.service"

uninstall:
	rm -f $(BINDIR)/tierfs $(SBINDIR)/mount.tierfs '$(UNITDIR)/tierfs@.service'
	rm -rf $(PREFIX) $(DOCDIR)
	-systemctl daemon-reload 2>/dev/null

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
