#!/usr/bin/env bash
# The all-to-all in two levels against the flat one (#57): the Llama example's Mixtral from flags on 2 simulated
# hosts (`zerorun bench cluster`, 1 Gbit/s links) x K ranks, E = 2K (every expert-parallel group is both hosts,
# one expert per rank at K = 4), stage 3; alternating runs with ZERORUN_ALL_TO_ALL=two-level and =flat, each
# run's median step, rank 0's all-to-all time a step (wall_clock_breakdown), the bytes per rank and step over the
# link and over loopback, and the last loss (the same in both: the all-to-all only moves rows). Needs root.
#
#   bash bench/moe/all_to_all_hosts.sh [K] [ROUNDS]          (default K = 4, 2 rounds; about 20 s a round)
#   MODEL="--layers 4 --hidden 512 --ffn 1024 --heads 8" bash bench/moe/all_to_all_hosts.sh 2
set -euo pipefail
cd "$(dirname "$0")/../.."
K=${1:-4} ROUNDS=${2:-2}
E=$((2 * K))
MODEL=${MODEL:-"--layers 2 --hidden 256 --ffn 512 --heads 4"}
ZR=target/release/zerorun LLAMA=$PWD/target/release/examples/llama
[ -x $ZR ] && [ -x $LLAMA ] && [ -x target/release/zerorun-torch ] || cargo build --release --bins --example llama
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cat > "$work/ds.json" <<JSON
{"train_batch_size": $((2 * E)), "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "wall_clock_breakdown": true,
 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
JSON
printf '%-6s %-10s %-14s %-18s %-22s %-22s %s\n' round mode median_step_s all_to_all_ms_step link_MiB_rank_step loopback_MiB_rank_step last_loss
for round in $(seq "$ROUNDS"); do
  for mode in two-level flat; do
    ZERORUN_ALL_TO_ALL=$mode $ZR bench cluster --hosts 2 --ranks-per-host "$K" --link 1gbit --json --log "$work/log" \
      -- "$LLAMA" --config "$work/ds.json" --experts "$E" --top-k 2 $MODEL --steps 6 --expert-parallel "$E" \
      > "$work/summary.json" 2> "$work/err"
    a2a=$(grep -oP 'all_to_all \K[\d.]+' "$work/log/host0.out")
    python3 - "$work/summary.json" "$round" "$mode" "$a2a" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
mib = lambda xs: "/".join(f"{x / 2**20:.1f}" for x in xs)
print(f"{sys.argv[2]:<6} {sys.argv[3]:<10} {d['median_step_s']:<14} {sys.argv[4]:<18} "
      f"{mib(d['cross_host_bytes_per_rank_per_step']):<22} {mib(d['inside_host_bytes_per_rank_per_step']):<22} {d['last_loss']}")
PY
  done
done
