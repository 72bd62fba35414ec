# zerorun: `make demo` (the main job) and `make test` (the whole suite) work on a fresh Debian machine with only
# the Rust toolchain and python3; both run the idempotent `make setup` first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
TORCH_VERSION := 2.11.0
# Debian packages the build and the tests need (checked with dpkg, installed only when missing).
# chromium: tests/monitors.rs renders the HTML memory report headless. openssh-*, slurm*, munge: tests/clusters.rs
# runs the real sshd and Slurm on simulated hosts (started and stopped by the test, nothing left running).
APT_PACKAGES := pkg-config libopenmpi-dev openmpi-bin libclang-dev fonts-dejavu-core libgloo-dev iproute2 chromium \
  openssh-client openssh-server slurmd slurmctld slurm-client munge
CARGO ?= cargo

.PHONY: setup demo test docs book-check bench bench-deepspeed bench-deepspeed-cluster gpu-binaries

setup: .libtorch
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "setup: installing Debian packages:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

# Python packages of the venv: torch (libtorch for tch), numpy (torch warns without it), safetensors (tests read
# zerorun's consolidated checkpoints from Python), transformers (the Llama example's tests compare against its
# LlamaForCausalLM; 4.57 is the newest whose dependencies PyPI here has), tensorboard (tests/monitors.rs reads the
# event files back with its EventAccumulator). Installed only when one is missing or a pin differs.
TRANSFORMERS_VERSION := 4.57.6
TENSORBOARD_VERSION := 2.21.0
PY_PACKAGES := torch==$(TORCH_VERSION) numpy safetensors transformers==$(TRANSFORMERS_VERSION) tensorboard==$(TENSORBOARD_VERSION)
VENV_STAMP := $(VENV)/.deps-torch$(TORCH_VERSION)-numpy-safetensors-transformers$(TRANSFORMERS_VERSION)-tensorboard$(TENSORBOARD_VERSION)

$(VENV_STAMP):
	@if ! $(VENV)/bin/python -c 'import torch, numpy, safetensors, transformers, tensorboard, sys; sys.exit(torch.__version__.split("+")[0] != "$(TORCH_VERSION)" or transformers.__version__ != "$(TRANSFORMERS_VERSION)" or tensorboard.__version__ != "$(TENSORBOARD_VERSION)")' 2>/dev/null; then \
	  echo "setup: installing $(PY_PACKAGES) into $(VENV)"; \
	  ( [ -x $(VENV)/bin/python ] || $(PYTHON) -m venv $(VENV) ) && \
	  $(VENV)/bin/pip install --quiet --progress-bar off --disable-pip-version-check $(PY_PACKAGES); \
	fi
	@touch $@

.libtorch: $(VENV_STAMP)
	@ln -sfn "$$($(VENV)/bin/python -c 'import torch,os; print(os.path.dirname(torch.__file__))')" .libtorch
	@touch -h .libtorch

# The main job: a 26M-parameter GPT on 2 ranks at stage 0, at stage 3, and at stage 3 with parameters and optimizer
# states on NVMe (/tmp/zerorun-nvme); each run writes its memory report (demo/*/memory.svg: per step and the peak's
# timeline), and `zerorun report compare` draws the three side by side: demo/stages.svg and demo/stages.png.
DEMO_GPT := --layers 8 --embd 512 --heads 8 --block 64 --steps 12
DEMO_RUN := ./target/release/zerorun launch --nproc-per-node 2 --memory-report
demo: setup
	$(CARGO) build --release --bins --example gpt
	rm -rf demo && mkdir -p demo /tmp/zerorun-nvme
	$(DEMO_RUN) demo/stage0 -- ./target/release/examples/gpt --config configs/zero0.json $(DEMO_GPT)
	$(DEMO_RUN) demo/stage3 -- ./target/release/examples/gpt --config configs/zero3.json $(DEMO_GPT)
	$(DEMO_RUN) demo/stage3_nvme -- ./target/release/examples/gpt --config configs/zero3_offload_nvme.json $(DEMO_GPT)
	./target/release/zerorun report compare demo/stage0 demo/stage3 demo/stage3_nvme \
	  --label "stage 0" --label "stage 3" --label "stage 3, NVMe" --out demo/stages

# House rules first (rustfmt.toml's width, clippy with warnings as errors), then the whole suite.
test: setup
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --features mpi,nccl -- -D warnings
	$(CARGO) test --workspace --all-targets --features mpi,nccl --no-fail-fast
	$(CARGO) test --workspace --doc --features mpi,nccl
	# The device path on CPU tensors (README "The device path"): the same suites through it.
	ZERORUN_DEVICE_EMULATION=1 $(CARGO) test --workspace --features mpi,nccl --test equivalence --test mixed_precision \
	  --test checkpoint --test async_training --test pipeline --test tensor_parallel --test stage2_hooks --test model_state \
	  --test all_reduce_in_backward
	# The device check's table with the device path emulated (exit 2: every row passed, no GPU here).
	$(CARGO) run --quiet --features mpi,nccl --example device_check; test $$? -eq 2
	./target/debug/zerorun launch --nproc-per-node 2 -- ./target/debug/examples/device_check
	$(MAKE) book-check

# The guide (docs/book, an mdBook) and the API docs. mdbook comes from crates.io into .tools/ when it is not on the
# PATH (about a minute and a half, once).
MDBOOK_VERSION := 0.5.4
MDBOOK := $(or $(shell command -v mdbook 2>/dev/null),.tools/bin/mdbook)
.tools/bin/mdbook:
	$(CARGO) install --quiet --locked --root .tools mdbook --version $(MDBOOK_VERSION) --no-default-features --features search

# The book builds and no link inside it (or a relative one of the README) is broken; the API docs build with no
# warning (missing docs, broken intra-doc links).
book-check: setup $(MDBOOK)
	$(MDBOOK) build docs/book
	$(PYTHON) scripts/check-links.py
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps --quiet

# Everything a reader gets: the configuration chapter regenerated from `zerorun config keys`, the book
# (target/book/index.html), the API docs (target/doc/zerorun/index.html), man pages and shell completions
# (target/docs/).
docs: setup $(MDBOOK)
	$(CARGO) build --quiet --bin zerorun
	./target/debug/zerorun config keys --markdown > docs/book/src/configuration/keys.md
	$(MAKE) book-check
	rm -rf target/docs && mkdir -p target/docs/man target/docs/completions
	./target/debug/zerorun man target/docs/man
	for shell in bash zsh fish; do ./target/debug/zerorun completions $$shell > target/docs/completions/zerorun.$$shell; done
	@echo "docs: target/book/index.html, target/doc/zerorun/index.html, target/docs/man, target/docs/completions"

# Binaries for scripts/gpu-check.sh on the GPU machine (no Rust toolchain there): stripped, under 64 MiB together.
gpu-binaries: setup
	$(CARGO) build --release --features nccl --bins --example gpu_probe --example nccl_check --example device_check
	mkdir -p gpu-bin
	strip -o gpu-bin/zerorun target/release/zerorun
	strip -o gpu-bin/zerorun-torch target/release/zerorun-torch
	strip -o gpu-bin/gpu_probe target/release/examples/gpu_probe
	strip -o gpu-bin/nccl_check target/release/examples/nccl_check
	strip -o gpu-bin/device_check target/release/examples/device_check

bench: setup
	$(CARGO) build --release --bins
	./target/release/zerorun bench adam

# zerorun beside DeepSpeed 0.19.8 (CPU, gloo) on the same GPT, weights, data order and ds_config.json: writes
# bench/deepspeed/results.{json,md}; then the Llama example beside transformers' LlamaForCausalLM under DeepSpeed
# (bench/deepspeed/llama_results.{json,md}). Not part of `make test` (it installs DeepSpeed and takes minutes).
bench-deepspeed: setup
	$(VENV)/bin/pip install -q deepspeed==0.19.8 ninja
	$(CARGO) build --release --bins --example gpt --example llama
	$(VENV)/bin/python bench/deepspeed/side_by_side.py
	$(VENV)/bin/python bench/deepspeed/llama_side_by_side.py

# zerorun beside DeepSpeed 0.19.8 across simulated hosts (network namespaces, rate-limited links; needs root):
# the 54.6M-parameter MLP at stages 0, 2, 3 and ZeRO++, 2 hosts x 1 and x 2 ranks, writes
# bench/deepspeed/cluster_results.{json,md}. CLUSTER_ARGS passes flags, e.g. CLUSTER_ARGS="--links 1gbit,10gbit".
bench-deepspeed-cluster: setup
	$(VENV)/bin/pip install -q deepspeed==0.19.8 ninja
	$(CARGO) build --release --bins --example mlp
	$(VENV)/bin/python bench/deepspeed/cluster_side_by_side.py $(CLUSTER_ARGS)
