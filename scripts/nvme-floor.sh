#!/usr/bin/env bash
# The NVMe step against the disk's floor (#63): a GPT at stage 3 with parameters and optimizer states on NVMe,
# 2 ranks, each shipped NVMe config, beside what ZeRO-Infinity must move per step at `bench swap`'s rates on the same
# folder, measured in the same run. Both configs run one sample per rank a step (the floor is I/O; the plain
# config's own batch of 24 would make its step compute). Per rank and step: fp32 parameters read in forward and in backward and written
# after the step (3 x 4 Psi / N), Adam's states read and written (2 x 8 Psi / N); both ranks share the disk, so the
# floor is all ranks' reads at the read rate plus their writes at the write rate.
#
#   bash scripts/nvme-floor.sh [LAYERS EMBD HEADS] [STEPS]      (default: 24 2048 16, the 1.2B GPT; 3 steps)
#   NVME_DIR=/path/on/nvme bash scripts/nvme-floor.sh
#   CONFIGS="configs/zero3_nvme_in_backward.json" BREAKDOWN=1 bash scripts/nvme-floor.sh   (one config; the
#   wall-clock breakdown of each run printed too)
set -euo pipefail
cd "$(dirname "$0")/.."
LAYERS=${1:-24} EMBD=${2:-2048} HEADS=${3:-16} STEPS=${4:-3}
DIR=${NVME_DIR:-/tmp/zerorun-nvme}
ZR=target/release/zerorun GPT=target/release/examples/gpt
[ -x $ZR ] && [ -x $GPT ] || cargo build --release --bin zerorun --example gpt
mkdir -p "$DIR"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
# Streaming rates of the swapper on the folder (1 GiB, median of 3) and the training pattern (2 ranks, 4 MiB chunks).
$ZR bench swap --dir "$DIR" --size 1073741824 --json -q > "$work/stream.json"
$ZR bench swap --dir "$DIR" --pattern training --ranks 2 --chunk 4194304 --size 536870912 --json -q > "$work/mixed.json"
for cfg in ${CONFIGS:-configs/zero3_offload_nvme.json configs/zero3_nvme_in_backward.json}; do
  python3 - "$cfg" "$DIR" "$work/$(basename "$cfg")" "${BREAKDOWN:-0}" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
for k in ("offload_optimizer", "offload_param"):
    c["zero_optimization"][k]["nvme_path"] = sys.argv[2]
c["wall_clock_breakdown"] = sys.argv[4] == "1"
# One sample per rank a step, as the floor is about I/O: zero3_offload_nvme.json's own batch (24) is 12 samples a
# rank, whose compute alone is most of its step.
for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
    c.pop(k, None)
c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"] = 1, 1
json.dump(c, open(sys.argv[3], "w"))
PY
  $ZR launch --nproc-per-node 2 -- $GPT --config "$work/$(basename "$cfg")" --layers "$LAYERS" --embd "$EMBD" \
    --heads "$HEADS" --block 64 --activation-checkpointing --steps "$STEPS" > "$work/$(basename "$cfg").log" 2>&1 \
    || { tail -20 "$work/$(basename "$cfg").log"; exit 1; }
done
python3 - "$work" "$LAYERS" "$EMBD" "$HEADS" <<'PY'
import json, re, sys, glob, os
work = sys.argv[1]
stream = json.load(open(f"{work}/stream.json"))
mixed = json.load(open(f"{work}/mixed.json"))
gib = 2**30
read, write = stream["read_gibps"] * gib, stream["write_gibps"] * gib
rows = []
for log in sorted(glob.glob(f"{work}/*.json.log")):
    text = open(log).read()
    params = int(re.search(r"(\d+) parameters", text).group(1)) if re.search(r"(\d+) parameters", text) else None
    median = float(re.search(r"median_step_s ([\d.]+)", text).group(1))
    steps = [int(m.group(1)) for m in re.finditer(r"step \d+ loss \S+ time (\d+) ms", text)]
    rss = [int(m.group(1)) for m in re.finditer(r"peak_rss_bytes (\d+)", text)]
    rows.append((os.path.basename(log)[:-4], params, median, steps, rss))
    for line in re.findall(r"wall_clock_breakdown over .*", text):
        print(f"{os.path.basename(log)[:-9]}: {line}")
psi = next(p for _, p, *_ in rows if p)
n = 2
reads, writes = n * (2 * 4 + 8) * psi / n, n * (4 + 8) * psi / n
floor = reads / read + writes / write
mixed_floor = (reads + writes) / (mixed["read_write_gibps_per_rank"] * gib * n)
print(f"GPT {sys.argv[2]} x {sys.argv[3]}, {psi:,} parameters, 2 ranks; the folder: read {stream['read_gibps']:.2f} GiB/s, "
      f"write {stream['write_gibps']:.2f} GiB/s (stream), {mixed['read_write_gibps_per_rank']:.2f} GiB/s per rank mixed (2 ranks)")
print(f"floor: {reads / 1e9:.1f} GB read + {writes / 1e9:.1f} GB written = {floor:.1f} s at the stream's rates, {mixed_floor:.1f} s at the mixed rate")
for name, _, median, steps, rss in rows:
    print(f"{name}: median step {median:.1f} s ({', '.join(f'{s / 1e3:.1f}' for s in steps)} s) = {median / floor:.2f}x the floor "
          f"({median / mixed_floor:.2f}x the mixed floor); peak RSS per rank {max(rss) / 2**20:.0f} MiB" if rss else f"{name}: median {median:.1f} s")
PY
