#!/usr/bin/env bash
# nanoGPT's published CPU run (its README: 4 layers, 4 heads, 128 wide, context 64, batch 12, 2,000 iterations,
# "a loss of only 1.88" in "about 3 minutes") beside the same model trained by zerorun at stage 3 on 2 ranks
# (configs/nanogpt_shakespeare_char.json, --arch nanogpt), in one sitting: wall time of each, their ratio, and the
# validation losses (nanoGPT's: its 20-batch estimate; zerorun's: the whole held-out split). NANOGPT_DIR is a
# checkout of karpathy/nanoGPT (not part of this project); its shakespeare_char data is prepared from
# examples/data/tinyshakespeare.txt (prepare.py's split and vocabulary, without the download).
#   cargo build --release --example gpt && bash scripts/nanogpt-sitting.sh NANOGPT_DIR [EVAL_EVERY]
set -euo pipefail
cd "$(dirname "$0")/.."
nanogpt=$(cd "${1:?usage: scripts/nanogpt-sitting.sh NANOGPT_DIR [EVAL_EVERY]}" && pwd)
eval_every=${2:-}
python=$PWD/.venv/bin/python
data=$nanogpt/data/shakespeare_char
if [ ! -f "$data/val.bin" ]; then
  cp examples/data/tinyshakespeare.txt "$data/input.txt"
  (cd "$data" && sed 's/^import requests$//' prepare.py > prepare_local.py && "$python" prepare_local.py >/dev/null)
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root=$PWD
# Seconds `"$@"` takes, its output to the log $1.
timed() { local log=$1 t0; shift; t0=$(date +%s.%N); "$@" > "$log" 2>&1 </dev/null; awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}'; }
zr=("$root/target/release/examples/gpt" --config "$root/configs/nanogpt_shakespeare_char.json" --arch nanogpt --ranks 2
  --layers 4 --heads 4 --embd 128 --block 64 --steps 2000 --data "$root/examples/data/tinyshakespeare.txt" --val-fraction 0.1)
[ -n "$eval_every" ] && zr+=(--eval-every "$eval_every")
# The config's monitors write under ./runs: the scratch folder's.
t_zr=$(cd "$work" && timed "$work/zerorun.log" "${zr[@]}")
t_ng=$(cd "$nanogpt" && timed "$work/nanogpt.log" "$python" train.py config/train_shakespeare_char.py --device=cpu \
  --compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 \
  --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0 --out_dir="$work/out")
val_zr=$(sed -n 's/^step 2000 val loss //p' "$work/zerorun.log")
val_ng=$(sed -n 's/^step 2000: .*val loss //p' "$work/nanogpt.log")
mfu=$(sed -n 's/^step 2000 loss .* mfu //p' "$work/zerorun.log")
printf '%-34s %9s %9s\n' run "wall s" "val loss"
printf '%-34s %9s %9s\n' "nanoGPT train.py (torch, 2 threads)" "$t_ng" "$val_ng"
printf '%-34s %9s %9s\n' "zerorun stage 3, 2 ranks" "$t_zr" "$val_zr"
echo "ratio zerorun / nanoGPT: $(awk -v a="$t_zr" -v b="$t_ng" 'BEGIN {printf "%.3f", a / b}'); zerorun's last step mfu $mfu"
