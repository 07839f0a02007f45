#!/usr/bin/env bash
# The MQAR grid of docs/results.md ("Associative recall"): Zoology's figure 2 protocol scaled
# down, every mixer at each rate, per (d_model, T, P) cell one `aftlab compare` run, then the
# table and the plot of accuracy against T.
#
#   bash benchmarks/mqar.sh                       # the whole grid, config defaults (hours on CPU)
#   DEVICE=cuda bash benchmarks/mqar.sh           # on a GPU
#   STEPS=2000 WIDTHS=64 CELLS="64:4" bash benchmarks/mqar.sh   # one small cell
#
# Environment: OUT (runs/mqar), DEVICE (auto), STEPS (the config's), LRS (3e-4,1e-3: the best on
# validation is reported; at d_model 128 attention learned only at 3e-4),
# WIDTHS ("64 128"), CELLS ("64:4 128:8 256:16", T:P), MIXERS (all six), SEEDS (1).
# A rerun continues: finished runs are read back (aftlab compare's resume).
set -euo pipefail
OUT=${OUT:-runs/mqar}
DEVICE=${DEVICE:-auto}
LRS=${LRS:-3e-4,1e-3}
WIDTHS=${WIDTHS:-64 128}
CELLS=${CELLS:-64:4 128:8 256:16}
MIXERS=${MIXERS:-attention,aft-decay,aft-simple,aft-local,aft-full,aft-conv}
SEEDS=${SEEDS:-1}
steps=()
if [[ -n "${STEPS:-}" ]]; then steps=(--steps "$STEPS"); fi

for d in $WIDTHS; do
  for cell in $CELLS; do
    T=${cell%%:*}; P=${cell##*:}; B=$((4096 / T))
    echo "== mqar d_model=$d T=$T P=$P batch=$B ($(date -u +%H:%M:%S))"
    aftlab compare --config configs/mqar.toml --mixers "$MIXERS" --lrs "$LRS" --seeds "$SEEDS" \
      "${steps[@]}" --set "device=\"$DEVICE\"" --set "seq_len=$T" --set "batch_size=$B" \
      --set "task_options.num_pairs=$P" --set "model.d_model=$d" --out "$OUT/d$d-T$T"
  done
done
python benchmarks/plot_mqar.py "$OUT" --out "$OUT/accuracy_vs_T.png"
