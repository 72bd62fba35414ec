#!/usr/bin/env bash
# A bare {"stage": 3} (the size keys sized from the model) beside the same config at stage 0 and the shipped
# configs/zero3.json: the highest rank's peak_rss_bytes and rank 0's median step, per MLP shape. Release binaries:
#   cargo build --release --bins --example mlp && bash scripts/bare-stage3.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# configs/zero3.json with its zero_optimization section replaced: the same optimizer, schedule and batch.
for stage in 0 3; do
  python3 -c "import json,sys; c=json.load(open('configs/zero3.json')); c['zero_optimization']={'stage': $stage}; json.dump(c, sys.stdout)" \
    > "$tmp/bare$stage.json"
done
shapes=(
  "4 x 8192|--in 8192 --hidden 8192 --layers 4 --out 8 --steps 4"
  "4 x 8192, in 1024|--in 1024 --hidden 8192 --layers 4 --out 8 --steps 6"
  "16 x 2048|--in 1024 --hidden 2048 --layers 16 --out 8 --steps 6"
)
run() {
  ./target/release/zerorun launch --nproc-per-node 2 -- ./target/release/examples/mlp --config "$1" $2 2>&1 |
    awk '/peak_rss_bytes/ {if ($4 > p) p = $4} /^\[rank 0\] median_step_s/ {s = $4} END {printf "%.0f %.3f", p / 1048576, s}'
}
printf '%-18s %16s %16s %16s %9s %9s\n' MLP "stage 0" "bare stage 3" "zero3.json" "3 / 0" "step / z3"
for s in "${shapes[@]}"; do
  name=${s%%|*}; args=${s#*|}
  read -r m0 t0 <<<"$(run "$tmp/bare0.json" "$args")"
  read -r m3 t3 <<<"$(run "$tmp/bare3.json" "$args")"
  read -r mz tz <<<"$(run configs/zero3.json "$args")"
  printf '%-18s %9s MiB %4ss %9s MiB %4ss %9s MiB %4ss %8.2fx %8.2fx\n' "$name" "$m0" "$t0" "$m3" "$t3" "$mz" "$tz" \
    "$(awk -v a="$m3" -v b="$m0" 'BEGIN {print a / b}')" "$(awk -v a="$t3" -v b="$tz" 'BEGIN {print a / b}')"
done
