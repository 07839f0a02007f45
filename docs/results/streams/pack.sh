#!/bin/bash
# pack_documents experiment: text-default, aft-decay and attention, with and without packing
cd /work/wt/r22-train
export OMP_NUM_THREADS=1 PYTHONPATH=$PWD/src
PY=/work/main/.venv/bin/python
for m in aft-decay attention; do
  for p in false true; do
    out=runs/r22/pack-$m-$p
    [ -f $out/summary.json ] && continue
    s=$(date +%s)
    $PY -m aftlab train --config configs/text-default.toml --mixer $m --set pack_documents=$p --set device=cpu --out $out > $out.train.log 2>&1
    e=$(date +%s)
    $PY -m aftlab eval $out --split test --device cpu > $out.eval.txt 2>&1
    f=$(date +%s)
    echo "$m pack=$p train_wall=$((e-s))s eval_wall=$((f-e))s $(cat $out.eval.txt)" >> runs/r22/pack.results
  done
done
