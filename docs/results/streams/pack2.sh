#!/bin/bash
# pack_documents experiment, second seed
cd /work/wt/r22-train
export OMP_NUM_THREADS=1 PYTHONPATH=$PWD/src
PY=/work/main/.venv/bin/python
while pgrep -f "runs/r22/(pack|stream).sh" > /dev/null; do sleep 20; done
for m in aft-decay attention; do
  for p in false true; do
    out=runs/r22/pack-$m-$p-seed1
    [ -f $out/summary.json ] && continue
    s=$(date +%s)
    $PY -m aftlab train --config configs/text-default.toml --mixer $m --set seed=1 --set pack_documents=$p --set device=cpu --out $out > $out.train.log 2>&1
    e=$(date +%s)
    $PY -m aftlab eval $out --split test --device cpu > $out.eval.txt 2>&1
    f=$(date +%s)
    echo "$m pack=$p seed=1 train_wall=$((e-s))s eval_wall=$((f-e))s $(cat $out.eval.txt)" >> runs/r22/pack.results
  done
done
