#!/usr/bin/env bash
# Per-rank activations and peak RSS of the Llama example (2 layers x 256 hidden, 8 heads, vocabulary 256, fp32,
# ZeRO stage 3, micro-batch 1) as each row's sequence grows and is split over S = 1, 2, 4 ranks (DeepSpeed-Ulysses),
# from the memory report (activations: their highest event; RSS: the process's peak), and the step-time breakdown
# (the all_to_all phase's mean ms per step beside forward and backward).
# Usage: bash bench/sequence/memory.sh [OUT_DIR]   (after cargo build --release --bins --examples)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-/tmp/zerorun-sequence-memory}
rm -rf "$out" && mkdir -p "$out"
cat >"$out/ds.json" <<'JSON'
{"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "wall_clock_breakdown": true,
 "steps_per_print": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "zero_optimization": {"stage": 3}}
JSON
for run in "1 1024" "1 2048" "1 4096" "2 2048" "2 4096" "2 8192" "4 4096" "4 8192"; do
  set -- $run
  s=$1 t=$2
  dir="$out/s${s}_t${t}"
  ./target/release/zerorun launch --nproc-per-node "$s" --memory-report "$dir" -- \
    ./target/release/examples/llama --config "$out/ds.json" --layers 2 --hidden 256 --heads 8 --seq-len "$t" \
    --steps 3 $([ "$s" -gt 1 ] && echo --sequence-parallel "$s") >"$dir.log" 2>&1
  python3 - "$dir" "$s" "$t" <<'PY'
import json, re, sys
d, s, t = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
peaks = []
for r in range(s):
    j = json.load(open(f"{d}/memory_rank{r}.json"))
    acts = max(e["categories"].get("activations", 0) for e in j["events"])
    peaks.append((acts / 2**20, j["peak_rss_bytes"] / 2**20))
log = open(d + ".log").read()
median = re.search(r"median_step_s ([0-9.]+)", log).group(1)
phases = dict(re.findall(r"(\w+) ([0-9.]+)", re.search(r"mean ms per step: (.*)", log).group(1)))
share = f" forward {phases['forward']} ms, backward {phases['backward']} ms, all_to_all {phases['all_to_all']} ms a step"
print(f"S={s} T={t}: activations per rank {max(x[0] for x in peaks):.1f} MiB, peak RSS per rank "
      f"{max(x[1] for x in peaks):.1f} MiB, median step {median} s;{share}")
PY
done
