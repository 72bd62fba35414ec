#!/usr/bin/env bash
# The device check (issue 11), run on the GPU machine from the repository root. It has no Rust toolchain: the
# binaries are built here (`make gpu-binaries`) and carried in gpu-bin/. They link libtorch dynamically; on the
# GPU machine the image's torch (the same 2.11.0 build) provides it, so LD_LIBRARY_PATH points there.
set -u
torch_lib=$(python3 -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
nvidia=$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__file__))' 2>/dev/null || true)
extra=""
if [ -n "$nvidia" ]; then for d in "$nvidia"/*/lib; do extra="$extra:$d"; done; fi
export LD_LIBRARY_PATH="$torch_lib$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "torch: $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
echo "libnccl: $(ls "$nvidia"/*/lib/libnccl* 2>/dev/null | tr "\n" " ")"
out=${OUT:-/tmp}
timeout 120 ./gpu-bin/gpu_probe 2>&1 | tee "$out/gpu_probe.txt"
echo "gpu_probe exit: ${PIPESTATUS[0]}"
timeout 120 ./gpu-bin/zerorun bench adam --params 16777216 --repeats 5 2>&1 | tee "$out/bench_adam_h200_host.txt"
