# The two commands the README starts with: `make demo` and `make test`.
# Each creates its own virtual environment (.venv) on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-12)

.PHONY: demo test unit lint typecheck proto-check docs-check house-check go-check bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP)
	$(BIN)/pdctl demo

test: $(STAMP) lint typecheck proto-check docs-check house-check go-check unit

unit: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check controller tests scripts benchmarks dashboards migrations setup.py
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy controller dashboards/build.py migrations/env.py

proto-check: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH bash scripts/check_generated.sh

docs-check: $(STAMP)
	$(BIN)/python -m controller.config --reference | diff -u docs/config-reference.md - \
		|| (echo "docs/config-reference.md is stale: run 'python -m controller.config --reference > docs/config-reference.md'"; exit 1)

# Functions a reader can hold (limits and exceptions: scripts/check_function_length.py).
house-check: $(STAMP)
	$(BIN)/python scripts/check_function_length.py

# The Go adopter package (adopters/go): gofmt, vet, and test against the conformance vectors.
# Offline (standard library only). Without go: skipped locally, an error with CI=true.
GO_ENV := GOFLAGS=-buildvcs=false GOPROXY=off GOTOOLCHAIN=local CGO_ENABLED=0
go-check:
	@if ! command -v go >/dev/null 2>&1; then \
		case "$${CI:-}" in 1|true|yes) echo "go-check: go is not installed (CI=true)"; exit 1;; esac; \
		echo "go-check: go is not installed, skipped (apt-get install golang)"; exit 0; fi; \
	export GOCACHE="$${GOCACHE:-$${XDG_CACHE_HOME:-$${HOME:-/tmp}/.cache}/go-build}"; \
	cd adopters/go && unformatted="$$(gofmt -l .)" && \
	if [ -n "$$unformatted" ]; then echo "go-check: not gofmt-formatted: $$unformatted"; exit 1; fi && \
	$(GO_ENV) go vet ./... && $(GO_ENV) go test ./...

clean:
	rm -rf $(VENV) node_modules .pytest_cache .mypy_cache .ruff_cache
