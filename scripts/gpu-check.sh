#!/usr/bin/env bash
# The device check (issues 4, 11 and 23), run on the GPU machine from the repository root. It has no Rust toolchain:
# the binaries are built here (`make gpu-binaries`) and carried in gpu-bin/. They link libtorch dynamically; on the
# GPU machine the image's torch (the same 2.11.0 build) provides it, so LD_LIBRARY_PATH points there.
set -u
# The timeouts below sum to 7 min 30 s: the whole check fits one device call with time to rerun it.
torch_lib=$(python3 -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
# `nvidia` is a namespace package: its folder comes from __path__.
nvidia=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
extra=""
if [ -n "$nvidia" ]; then for d in "$nvidia"/*/lib; do extra="$extra:$d"; done; fi
# cudarc loads libnccl.so, the wheel ships libnccl.so.2. It must be the very file libtorch_cuda loads: a second
# NCCL in the process (say /usr/lib's) makes the two copies interpose each other's symbols ("corrupted comm").
nccl_so=$(find "$nvidia" -name libnccl.so.2 2>/dev/null | head -n 1)
shim=""
if [ -n "$nccl_so" ]; then
  mkdir -p /tmp/zerorun-nccl && ln -sf "$nccl_so" /tmp/zerorun-nccl/libnccl.so && shim="/tmp/zerorun-nccl:"
fi
export LD_LIBRARY_PATH="$shim$torch_lib$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "torch: $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
echo "libnccl: ${nccl_so:-none found}"
out=${OUT:-/tmp}
timeout 90 ./gpu-bin/gpu_probe 2>&1 | tee "$out/gpu_probe.txt"
echo "gpu_probe exit: ${PIPESTATUS[0]}"
timeout 60 ./gpu-bin/zerorun bench adam --params 16777216 --repeats 5 2>&1 | tee "$out/bench_adam_h200_host.txt"
NCCL_DEBUG=WARN timeout 90 ./gpu-bin/nccl_check 2>&1 | tail -n 12 | tee "$out/nccl_check.txt"
echo "nccl_check exit: ${PIPESTATUS[0]}"
# The engine with CUDA tensors against the host run, stages 0-3, bf16, CPU offload: one Markdown table.
timeout 120 ./gpu-bin/device_check 2>&1 | tee "$out/device_check.md"
echo "device_check exit: ${PIPESTATUS[0]}"
# Two processes sharing the GPU through the launcher's shm backend (host-staged), stage 3: one more row.
timeout 90 ./gpu-bin/zerorun launch --nproc-per-node 2 -- ./gpu-bin/device_check 2>&1 | tee -a "$out/device_check.md"
echo "device_check launched exit: ${PIPESTATUS[0]}"
