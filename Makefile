# Two commands on a fresh machine:
#   make lab    create the environment, install everything, open JupyterLab on the notebooks
#   make test   same set-up, then every test
#
# The tests in tiers (tests/conftest.py says how a test gets its tier):
#   make lint           ruff and mypy (test-fast and test run it first)
#   make test-fast      no process started; seconds
#   make test-cluster   real clusters, process groups, kernels and servers
#   make test-e2e       the notebooks (nbval), the browser, Binder, the soak
#
# torch is installed first, pinned to the build this machine carries, so pip does not pull a
# newer torch with gigabytes of CUDA libraries; the package itself asks for torch>=2.11,<2.14 (the releases run).
# Override on other machines: make test TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu"

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.distlab-installed
PORT ?= 8888
# make test runs the test files on this many workers side by side (pytest-xdist, a whole file to a
# worker): a third of the two cores sat idle in one process, the tests waiting on deadlines,
# heartbeats, links, browsers and pip. TEST_WORKERS=0 runs them in one process.
TEST_WORKERS ?= 2

.PHONY: lab lint test test-fast test-cluster test-e2e system-deps clean

$(STAMP): pyproject.toml Makefile extension/package.json $(wildcard extension/src/* extension/style/*)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip check
	# JupyterHub's proxy, for a class's hub (distlab.classroom), beside the environment that runs it.
	npm install --prefix $(VENV) --no-save --no-audit --no-fund --loglevel=error configurable-http-proxy@4
	touch $(STAMP)

# Open MPI's mpiexec, for the MPI launcher test; iproute2 (ip, tc) for labs on emulated nodes and
# OpenSSH for the SSH launcher test across them; munge and Slurm (slurmctld, slurmd, its clients) for the
# Slurm launcher test on them; Chromium, for the browser tests (driven by
# Playwright; its own browser download is not used): installed with apt when missing and we may.
# Node.js 20+ builds the JupyterLab extension (extension/) when pip installs distlab.
system-deps:
	@command -v mpiexec >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null; \
	  else echo "install Open MPI (Debian: sudo apt-get install openmpi-bin libopenmpi-dev), then re-run" >&2; exit 1; fi; }
	@{ command -v ip && command -v tc && test -x /usr/sbin/sshd; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 openssh-server openssh-client >/dev/null; \
	  else echo "install iproute2 and OpenSSH (Debian: sudo apt-get install iproute2 openssh-server openssh-client), then re-run" >&2; exit 1; fi; }
	@{ test -x /usr/sbin/munged && test -x /usr/sbin/slurmctld && test -x /usr/sbin/slurmd && command -v sbatch; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq munge slurmctld slurmd slurm-client >/dev/null; \
	  else echo "install Slurm (Debian: sudo apt-get install munge slurmctld slurmd slurm-client), then re-run" >&2; exit 1; fi; }
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "install Chromium (Debian: sudo apt-get install chromium), then re-run" >&2; exit 1; fi; }
	@node -e 'process.exit(Number(process.versions.node.split(".")[0]) < 20 ? 1 : 0)' 2>/dev/null || { \
	  echo "install Node.js 20 or newer (https://nodejs.org), then re-run: pip builds the side panel with it" >&2; exit 1; }

lab: $(STAMP)
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks --port=$(PORT)

# ruff, then mypy (strict on distlab/; pyproject.toml lists the modules still pending): both before any test.
lint: $(STAMP)
	$(VENV)/bin/ruff check distlab tests benchmarks scripts
	$(PY) -m mypy

test: system-deps $(STAMP) lint
	$(PY) -m pytest -p no:cacheprovider --numprocesses=$(TEST_WORKERS) --dist=loadfile --no-loadscope-reorder --durations=40

test-fast: $(STAMP) lint
	$(PY) -m pytest -p no:cacheprovider -m "not cluster and not e2e"

test-cluster: system-deps $(STAMP)
	$(PY) -m pytest -p no:cacheprovider -m "cluster and not e2e"

test-e2e: system-deps $(STAMP)
	$(PY) -m pytest -p no:cacheprovider -m e2e

clean:
	rm -rf $(VENV) build dist *.egg-info distlab/labextension extension/lib extension/node_modules \
	  extension/.yarn extension/tsconfig.tsbuildinfo
