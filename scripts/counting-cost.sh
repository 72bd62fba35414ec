#!/usr/bin/env bash
# The counting allocator's cost: median step of the same runs with it (the default) and without it
# (ZERORUN_COUNT_ALLOCATIONS=0), alternated so drift hits both alike. Release binaries:
#   cargo build --release --bins --example mlp --example gpt && bash scripts/counting-cost.sh [REPS]
set -euo pipefail
cd "$(dirname "$0")/.."
reps=${1:-3}
launch="./target/release/zerorun launch --nproc-per-node 2 --"
runs=(
  "mlp stage 0|$launch ./target/release/examples/mlp --config configs/zero0.json --in 1024 --hidden 4096 --layers 5 --out 8 --steps 8"
  "mlp stage 3|$launch ./target/release/examples/mlp --config configs/zero3.json --in 1024 --hidden 4096 --layers 5 --out 8 --steps 8"
  "gpt stage 0|$launch ./target/release/examples/gpt --config configs/zero0.json --layers 8 --embd 512 --heads 8 --block 64 --steps 6"
  "gpt stage 3|$launch ./target/release/examples/gpt --config configs/zero3.json --layers 8 --embd 512 --heads 8 --block 64 --steps 6"
)
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
step() { env "$@" 2>&1 | sed -n 's/^\[rank 0\] median_step_s //p'; }
printf '%-12s %12s %12s %8s\n' run "counting s" "plain s" ratio
for r in "${runs[@]}"; do
  name=${r%%|*}; cmd=${r#*|}
  on=(); off=()
  for _ in $(seq "$reps"); do
    on+=("$(step ZERORUN_COUNT_ALLOCATIONS=1 $cmd)")
    off+=("$(step ZERORUN_COUNT_ALLOCATIONS=0 $cmd)")
  done
  a=$(printf '%s\n' "${on[@]}" | median); b=$(printf '%s\n' "${off[@]}" | median)
  printf '%-12s %12.4f %12.4f %8s\n' "$name" "$a" "$b" "$(awk -v a="$a" -v b="$b" 'BEGIN {printf "%.3f", a / b}')"
done
