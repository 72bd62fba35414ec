#!/usr/bin/env bash
# Does `zerorun plan` rank first the configuration that runs fastest? For the GPT example at three sizes on 2 ranks
# of this machine: plan the candidates (global batch 8, fp32), then run the planner's best of each of the first 5
# kinds (stage, offload, pipeline, tensor, recomputation) and print predicted and measured median steps side by side. Needs the release build: cargo build --release --bins --example gpt.
set -euo pipefail
cd "$(dirname "$0")/.."
ZR=target/release/zerorun
GPT=target/release/examples/gpt
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/nvme"
# This machine as a cluster of 2 ranks; flops_per_rank left out so that plan measures it at each model's shape.
$ZR plan measure --ranks-per-host 2 --nvme-dir "$work/nvme" | python3 -c 'import json,sys; c=json.load(sys.stdin); c.pop("flops_per_rank"); print(json.dumps(c))' >"$work/cluster.json"
for size in "4 256 4" "6 512 8" "8 768 12"; do
  read -r layers embd heads <<<"$size"
  echo "{\"layers\": $layers, \"hidden\": $embd, \"heads\": $heads, \"vocab\": 65, \"seq_len\": 64}" >"$work/model.json"
  $ZR plan --model "$work/model.json" --cluster "$work/cluster.json" --global-batch 8 --top 500 --json \
    --write-config "$work/cfg" --nvme-path "$work/nvme" >"$work/plan.json"
  echo "GPT $layers x $embd, $heads heads, block 64, global batch 8, 2 ranks:"
  python3 - "$work/plan.json" <<'PY' >"$work/rows.txt"
import json, sys
seen = set()
for i, r in enumerate(json.load(open(sys.argv[1]))["rows"]):
    kind = (r["stage"], r["offload"], r["pipeline"], r["tensor"], r["activation_checkpointing"])
    if kind in seen or len(seen) == 5:
        continue
    seen.add(kind)
    flags = []
    if r["tensor"] > 1: flags += ["--tensor-parallel", str(r["tensor"])]
    if r["pipeline"] > 1: flags += ["--pipeline-stages", str(r["pipeline"])]
    if r["activation_checkpointing"]: flags += ["--activation-checkpointing"]
    name = f'stage {r["stage"]} {r["offload"]} pp{r["pipeline"]} tp{r["tensor"]} micro {r["micro_batch"]}' + (" ac" if r["activation_checkpointing"] else "")
    print(f'{i+1}|{name}|{r["step_seconds"]:.4f}|{" ".join(flags)}')
PY
  while IFS='|' read -r n name predicted flags; do
    cfg=$(printf "%s/cfg/plan-%02d.json" "$work" "$n")
    # shellcheck disable=SC2086
    measured=$($ZR launch --nproc-per-node 2 -- $GPT --config "$cfg" --layers "$layers" --embd "$embd" --heads "$heads" \
      --block 64 --steps 6 $flags 2>/dev/null | sed -n 's/^\[rank 0\] median_step_s //p')
    printf "  #%s %-42s predicted %7.3f s  measured %7.3f s\n" "$n" "$name" "$predicted" "$measured"
  done <"$work/rows.txt"
done
