#!/usr/bin/env bash
# The token-shift ablation of docs/results.md (issue 26, section 3): MQAR in Zoology's layout
# (configs/mqar-zoology.toml: vocabulary 8192, 2 layers, no feed-forward, one head), per cell
# (d_model, T, P) and mixer one `aftlab compare` invocation (each within about 30 minutes on the
# 2-CPU machine at the default STEPS), then the table of every cell.
#
#   bash benchmarks/mqar_ablation.sh                              # the grid (hours on CPU)
#   CELLS="64:64:4" MIXERS="aft-decay" STEPS=200 bash benchmarks/mqar_ablation.sh   # a probe
#
# Environment: OUT (runs/mqar-zoology), DEVICE (auto), STEPS (2000), LRS (Zoology's grid
# 1e-4,4.6e-4,2.2e-3,1e-2), SEEDS (1; the issue asks 2 at the best rate: rerun that cell with
# SEEDS=2 LRS=<best>), CELLS ("64:64:4 128:64:4 128:128:8", d:T:P), MIXERS (below).
# aft-decay:token_shift=true is the rwkv4 mixer (RWKV-4's time mix), which in this layout (no
# feed-forward) is Zoology's "RWKV"; it is trained once, under its aft-decay name.
# A rerun continues: finished runs are read back (aftlab compare's resume).
set -euo pipefail
OUT=${OUT:-runs/mqar-zoology}
DEVICE=${DEVICE:-auto}
STEPS=${STEPS:-2000}
LRS=${LRS:-1e-4,4.6e-4,2.2e-3,1e-2}
SEEDS=${SEEDS:-1}
CELLS=${CELLS:-64:64:4 128:64:4 128:128:8}
MIXERS=${MIXERS:-attention aft-decay aft-decay:token_shift=true aft-local:token_shift=true aft-conv:token_shift=true}

for cell in $CELLS; do
  IFS=: read -r d T P <<< "$cell"
  B=$((4096 / T))
  for m in $MIXERS; do
    echo "== mqar-zoology d_model=$d T=$T P=$P batch=$B $m ($(date -u +%H:%M:%S))"
    start=$SECONDS
    aftlab compare --config configs/mqar-zoology.toml --mixers "$m" --lrs "$LRS" \
      --seeds "$SEEDS" --steps "$STEPS" --set "device=\"$DEVICE\"" --set "seq_len=$T" \
      --set "batch_size=$B" --set "task_options.num_pairs=$P" --set "model.d_model=$d" \
      --out "$OUT/d$d-T$T-${m//[:=]/_}"
    echo "== done in $((SECONDS - start)) s"
  done
done
python benchmarks/plot_mqar.py "$OUT" --out "$OUT/accuracy_vs_T.png"
