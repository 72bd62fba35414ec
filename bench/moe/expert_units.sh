#!/usr/bin/env bash
# Stage 3 with each expert-parallel position's experts a unit split over that position's ranks (#57): the Llama
# example's Mixtral from flags on 4 rank processes at E = 1 (every unit over every rank), 2 and 4, alternating
# rounds, each run's median step and rank 0's peak RSS, and the losses (the same at every E).
#
#   bash bench/moe/expert_units.sh [ROUNDS]        (default 2; about 40 s a round on 2 cores)
#   FLAGS=--activation-checkpointing bash bench/moe/expert_units.sh   (extra flags for every run)
#   ZERO='"stage": 2' bash bench/moe/expert_units.sh                     (the zero_optimization block's keys)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${1:-2}
ZR=target/release/zerorun LLAMA=target/release/examples/llama
[ -x $ZR ] && [ -x $LLAMA ] || cargo build --release --bin zerorun --example llama
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
ZERO=${ZERO:-'"stage": 3, "stage3_param_persistence_threshold": 0'}
cat > "$work/ds.json" <<JSON
{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
 "zero_optimization": {$ZERO}}
JSON
printf '%-6s %-3s %-14s %-16s %s\n' round E median_step_s peak_rss_rank0 losses
for round in $(seq "$ROUNDS"); do
  for e in 1 2 4; do
    out=$($ZR launch --nproc-per-node 4 -- $LLAMA --config "$work/ds.json" --experts 8 --top-k 2 --layers 4 \
      --hidden 512 --ffn 1024 --heads 8 --steps 6 --expert-parallel "$e" ${FLAGS:-} 2>&1)
    median=$(grep -oP '^\[rank 0\] median_step_s \K[\d.]+' <<<"$out")
    rss=$(grep -oP '^\[rank 0\] peak_rss_bytes \K\d+' <<<"$out")
    losses=$(grep -oP '^\[rank 0\] summary: .*loss \K.*' <<<"$out")
    printf '%-6s %-3s %-14s %-16s %s\n' "$round" "$e" "$median" "$((rss / 1000000)) MB" "$losses"
  done
done
