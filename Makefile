# Fresh-machine entry points: `make demo` (set up + report) and `make test` (set up + tests).
# torch is pinned to the local CPU wheel: an unpinned torch pulls a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
OUT ?= report
# pure modules (no torch): mypy --strict
PURE := $(addprefix src/kvstate/prefix/,placement.py envelope.py histogram.py tree_placement.py tree_plan.py eviction.py store.py config.py store_types.py store_eviction.py store_learning.py hashing.py) src/kvstate/serve/policy.py src/kvstate/lab/prefix/evaluate.py src/kvstate/lab/workloads/traces.py src/kvstate/semantic/segment.py src/kvstate/depth/patterns.py src/kvstate/depth/registry.py src/kvstate/transfer/lowrank.py src/kvstate/lab/journal.py

.PHONY: setup demo test lint bench reproduce clean clients

$(STAMP): pyproject.toml
	command -v chromium >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium) \
		|| echo "warning: Chromium not installed; the report's browser test will fail (apt-get install -y chromium)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	command -v redis-server >/dev/null 2>&1 || { S=$$(test "$$(id -u)" -eq 0 || echo sudo); \
		$$S apt-get update -qq && $$S apt-get install -y -qq redis-server; }
	command -v tc >/dev/null 2>&1 || { S=$$(test "$$(id -u)" -eq 0 || echo sudo); \
		$$S apt-get update -qq && $$S apt-get install -y -qq iproute2; } \
		|| echo "warning: iproute2 not installed; the shaped-link TTFT tests will skip"
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# kvpress (the SEKV bench's press baselines) in its own environment: it pins transformers<5.3 and patches attention
KVPRESS := .venv-kvpress/.installed
MAKE_KVPRESS := $(BIN)/python -c "from pathlib import Path; from kvstate.lab.semantic.baselines_kvpress import ensure_env; ensure_env(Path('.venv-kvpress'))"
$(KVPRESS): $(STAMP) src/kvstate/lab/semantic/baselines_kvpress.py
	$(MAKE_KVPRESS) || { rm -rf .venv-kvpress && $(MAKE_KVPRESS); }
	touch $(KVPRESS)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvstate report --out $(OUT)

test: $(STAMP) $(KVPRESS)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy --strict $(PURE)

bench: $(STAMP)
	for f in benchmarks/*.py; do $(BIN)/python $$f || exit 1; done

# regenerate every committed result the report reads (not the weights); resumable, prints an estimate first
reproduce: $(STAMP) $(KVPRESS)
	OMP_NUM_THREADS=1 $(BIN)/kvstate lab reproduce

# the standard load clients the serving benchmarks drive, each in its own environment (never a library dependency):
# GuideLLM (Python 3.11) and inference-perf (needs Python >= 3.12: python3.12 on PATH or pyenv's)
PY312 ?= $(shell command -v python3.12 2>/dev/null || ls -d /root/.pyenv/versions/3.12*/bin/python 2>/dev/null | tail -1)
clients: .venv-guidellm/.installed .venv-infperf/.installed
.venv-guidellm/.installed:
	test -x .venv-guidellm/bin/python || $(PY) -m venv .venv-guidellm
	.venv-guidellm/bin/pip install -q 'guidellm>=0.3'
	touch $@
.venv-infperf/.installed:
	@test -n "$(PY312)" || { echo "inference-perf needs Python >= 3.12: install python3.12 or pass PY312=/path/to/python3.12"; exit 2; }
	test -x .venv-infperf/bin/python || $(PY312) -m venv .venv-infperf
	.venv-infperf/bin/pip install -q 'inference-perf>=0.7'
	touch $@

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache
